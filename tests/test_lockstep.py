"""Decoding in lockstep (ZeRO-3 with ds3_gather_for_generation=False): a process whose rows are done
keeps running its model until every process is done, so the per-layer gathers stay matched.
The two-process run is in tests/test_distributed.py (scenario no_gather_uneven_stop)."""

import torch
from tiny_models import ScriptedDecoder
from transformers import GenerationConfig

from grpo_hf.engine import local


class LockstepDecoder(ScriptedDecoder):
    """A ScriptedDecoder that may also be fed a finished row: the spare row a done process keeps
    stepping in lockstep."""

    def __call__(self, token):
        self.step += 1
        return self.logits()


def generate(monkeypatch, all_done):
    decoder = LockstepDecoder([2, 3])
    monkeypatch.setattr(local, "decoder_for", lambda *args: decoder)
    ids = torch.ones(2, 3, dtype=torch.long)
    config = GenerationConfig(do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=[2])
    return local.generate(
        torch.nn.Linear(1, 1), ids, torch.ones_like(ids), config, all_done=all_done
    ), decoder


def test_a_finished_process_keeps_stepping_until_every_process_is_done(monkeypatch):
    told = []

    def all_done(done: bool) -> bool:  # the other processes finish at step 4
        told.append(done)
        return len(told) == 5

    result, decoder = generate(monkeypatch, all_done)
    assert told == [False, False, True, True, True]  # asked once per step; done from step 2 on
    # Prefill (2 rows), steps 0-1 as without lockstep (2 rows, then the row still going), then
    # one spare row fed at steps 2 and 3 while the others finish.
    assert decoder.rows_per_call == [2, 2, 1, 1, 1]
    assert result.completion_ids.tolist() == [[3, 2, 0, 0, 0], [3, 3, 2, 0, 0]]
    assert result.completion_mask.sum(1).tolist() == [2, 3]


def test_without_lockstep_a_process_stops_when_its_rows_are_done(monkeypatch):
    result, decoder = generate(monkeypatch, None)
    assert decoder.rows_per_call == [2, 2, 1]
    assert result.completion_ids.tolist() == [[3, 2, 0], [3, 3, 2]]
