"""Engine-level load and speed figures, the message an instance reports to the router each step."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine after a step (what Llumnix calls an instance's load)."""

    running: int  # requests holding KV and stepping
    waiting: int  # queued or preempted requests
    kv_blocks_used: int  # the target's cache (every target shard has the same block count)
    kv_blocks_free: int
    draft_kv_blocks_used: int
    draft_kv_blocks_free: int
    num_steps: int
    step_time_s: float  # the last step's wall time
    step_time_ema_s: float  # exponentially weighted over steps (weight 0.1 for the newest)
    batch_size: int  # requests in the last step
    batch_tokens: int  # target tokens in the last step (prefill chunks + decodes + drafts)
    prefill_tokens: int  # of which prefill
    mean_k: float  # mean k over the last step's emitting requests
    acceptance: float  # the engine-wide acceptance estimate
    tokens_emitted: int  # generated tokens since start
    num_preemptions: int  # since start
    policy: str
    # drafting (EasySpec figures: actors/spec/easyspec.py): draft-stage seconds per drafted token since start,
    # acceptance rate at each draft position (1st, 2nd, ...), and bonus calibration's re-run tokens and seconds
    draft_s_per_token: float = 0.0
    acceptance_by_position: tuple[float, ...] = ()
    calibration_tokens: int = 0
    calibration_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)
