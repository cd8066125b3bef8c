"""A request's row reaches the ledger at its first token, however its prompt was computed: a router
restarted before the next periodic checkpoint (128 steps) finds it there, and so does a decode worker the
prompt's KV is handed to (the ledger moves the row with the blocks)."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, SamplingParams

pytestmark = pytest.mark.unit


class RecordingSync:
    """Stands in for the engine's LedgerSync: what each step asks it to write."""

    def __init__(self) -> None:
        self.steps: list[tuple[bool, dict[str, int]]] = []

    def before_execute(self, blocks) -> None:  # noqa: ANN001 - the engine's block manager
        pass

    def after_step(self, requests, blocks, prompt_done: bool) -> dict[str, str]:  # noqa: ANN001
        self.steps.append((prompt_done, {r.request_id: len(r.output_ids) for r in requests}))
        return {}

    def finished(self, request) -> None:  # noqa: ANN001
        pass


def test_a_prompt_cached_but_its_last_token_is_checkpointed_at_its_first_token(small_config, small_model, make_engine):
    """The soak's seed 7: a prompt whose full blocks another request had cached left one token to compute,
    scheduled as a decode row: the step that gave its first token did not count as a prompt done, no row
    was written, and the client resuming after a router restart got a 404."""
    bs = small_config.cache.block_size
    ids = small_model.tokenizer.encode("The lighthouse keeper kept the lamp burning all night long. ") * 40
    ids = ids[: 3 * bs + 1]  # three full blocks and one token
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = make_engine(small_config, small_model)
    engine.generate([AddRequest("first", ids, params)])  # its three full blocks now cached
    sync = RecordingSync()
    engine.sync = sync
    engine.add_request(AddRequest("again", ids, params))
    (out,) = engine.step()
    assert out.num_cached_tokens == 3 * bs and out.index == 0  # the last token alone was computed
    assert sync.steps[0] == (True, {"again": 1})  # its row is due now, with its first token
    engine.step()
    assert sync.steps[1][0] is False  # (a plain decode step: the periodic checkpoint's business)
