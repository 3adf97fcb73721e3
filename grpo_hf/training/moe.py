"""Mixture-of-Experts load balancing: the router's auxiliary loss (Switch Transformer, arXiv
2101.03961, eqs. 4-6), added to the GRPO loss with weight `router_aux_loss_coef`, as TRL does.

What is computed is TRL's number: the model's own `load_balancing_loss_func` over every real token
of whole rows (prompt + completion, padding left out), as a forward with `output_router_logits=True`
returns it in `aux_loss`. Our loss pass (`engine.logprobs`) runs each distinct prompt once and the
completions after it, so the routers see U prompts, then B completions: their outputs are recorded
during that pass (with forward hooks on the router modules transformers itself records for
`output_router_logits`) and weighted per token: a prompt token once per row holding that prompt, a
completion token once, padding not at all. Routing is per token, so this is the whole-row value
without running any prompt twice. With the loss multiplied by the coefficient and the Trainer
dividing each micro-step's loss by the accumulation steps, an optimizer step gets
`coef x` the mean of its micro-batches' aux losses, as in TRL. Logged as `aux_loss`.
"""

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from grpo_hf.engine.logprobs import unique_rows
from grpo_hf.engine.packing import unwrapped


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers."""
    return next(m for m in unwrapped(model).modules() if isinstance(m, PreTrainedModel))


def resolve_router_aux_loss_coef(model: nn.Module, coef: float | None) -> float:
    """The coefficient in use: `coef`, or the model config's own when None (0 without one); 0 for a
    model that returns no router logits. A non-zero `coef` for such a model is an error."""
    config = _causal_lm(model).config.get_text_config()
    moe = hasattr(config, "output_router_logits")
    if coef and not moe:
        raise ValueError(
            f"router_aux_loss_coef={coef} but {type(_causal_lm(model)).__name__} is not a Mixture-of-Experts model "
            "that returns router logits: there is no load-balancing loss to weight. Unset router_aux_loss_coef."
        )
    resolved = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return float(resolved) if moe else 0.0


class RouterAuxLoss:
    """Records the router logits of a loss pass (`recording`) and adds the load-balancing loss (`added_to`).

    With coefficient 0 both do nothing.
    """

    def __init__(self, model: nn.Module, coef: float | None):
        self.coef = resolve_router_aux_loss_coef(model, coef)
        if self.coef == 0.0:
            return
        lm = _causal_lm(model)
        recorder = type(lm)._can_record_outputs.get("router_logits") if lm._can_record_outputs else None
        loss_func = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
        router_class = getattr(recorder, "target_class", recorder)
        if not isinstance(router_class, type) or loss_func is None:
            raise ValueError(
                f"router_aux_loss_coef: the router logits of {type(lm).__name__} cannot be recorded here; set "
                "router_aux_loss_coef=0 to train without the load-balancing loss."
            )
        self.index = getattr(recorder, "index", 0)
        self.routers = [m for m in lm.modules() if isinstance(m, router_class)]
        self.decoder = lm.get_decoder()
        self.loss_func, self.num_experts, self.top_k = loss_func, lm.num_experts, lm.num_experts_per_tok

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[dict] | None]:
        """Within: every call of the model's decoder, with its attention mask, its width and each
        router's logits (layer by layer). None when the loss is off."""
        if self.coef == 0.0:
            yield None
            return
        calls: list[dict] = []

        def on_call(module, args, kwargs):
            tokens = kwargs.get("input_ids")
            tokens = kwargs["inputs_embeds"] if tokens is None else tokens
            calls.append({"mask": kwargs["attention_mask"], "width": tokens.shape[1], "logits": []})

        def on_route(module, args, output):
            calls[-1]["logits"].append(output[self.index])  # (R * T, E)

        handles = [self.decoder.register_forward_pre_hook(on_call, with_kwargs=True)]
        handles += [router.register_forward_hook(on_route) for router in self.routers]
        try:
            yield calls
        finally:
            for handle in handles:
                handle.remove()

    def loss(
        self, calls: list[dict], input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int
    ) -> torch.Tensor:
        """The load-balancing loss of the whole rows (B, P + C) from the `calls` recorded while they
        went through the model: whole rows, or their distinct prompts and then their completions."""
        prompt_width = input_ids.shape[1] - completion_width
        _, row_to_unique = unique_rows(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])  # (B,)
        copies = torch.bincount(row_to_unique).float()  # (U,) rows holding each distinct prompt
        layers = len(self.routers)
        weights = []
        for call in calls:
            weight = call["mask"][:, -call["width"] :].float()  # (R, T) the call's own tokens
            if len(call["logits"]) != layers or weight.shape[0] not in (input_ids.shape[0], copies.shape[0]):
                raise RuntimeError(
                    f"a model call of {weight.shape[0]} rows with {len(call['logits'])} router outputs: expected "
                    f"{input_ids.shape[0]} rows or their {copies.shape[0]} distinct prompts, and {layers} outputs."
                )
            if weight.shape[0] != input_ids.shape[0]:  # the distinct prompts, run once for their rows
                weight = weight * copies.unsqueeze(1)  # (U, P)
            weights.append(weight.reshape(-1))  # (R * T,)
        gate_logits = tuple(
            torch.cat([call["logits"][i] for call in calls]) for i in range(layers)
        )  # (N, E) each
        return self.loss_func(gate_logits, self.num_experts, self.top_k, torch.cat(weights))

    def added_to(
        self, loss: torch.Tensor, calls: list[dict] | None, inputs: dict, metrics: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """`loss` + coef x the load-balancing loss (recorded in `metrics` as 'aux_loss'); `loss` when off."""
        if calls is None:
            return loss
        aux = self.loss(
            calls, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"].shape[1]
        )
        metrics["aux_loss"] = aux.detach()
        return loss + self.coef * aux
