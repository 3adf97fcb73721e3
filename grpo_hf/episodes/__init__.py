"""How the completions of a round are made beyond one sampling call: multi-turn tool episodes
(`multi_turn`, `tools`), environments (`environments`), the user's `rollout_func`
(`rollout_func`), and DAPO's dynamic sampling of extra rounds (`dynamic_sampling`)."""
