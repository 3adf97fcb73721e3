"""How the completions of a round are made and scored (`scored_round`): one sampling call, or
multi-turn tool episodes (`multi_turn`, `tools`), environments (`environments`), the user's
`rollout_func` (`rollout_func`); DAPO's dynamic sampling of extra rounds (`dynamic_sampling`); async
GRPO's rounds sampled ahead (`async_rounds`) on its generation thread (`round_queue`)."""
