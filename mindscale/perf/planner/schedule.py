"""The pipeline schedule: the forwards a stage holds in flight, its stage-boundary sends and the bubble.

Under 1F1B stage k holds ``p - k`` micro batches in flight (stage 0 holds p); interleaved 1F1B with v chunks per
stage (Narayanan et al. 2021, §2.2.2, as Megatron-LM schedules it) holds ``min(2(p-k-1) + (v-1)p + 1, v·m)``
chunk forwards, stage 0 ``v·p + p - 1`` (`in_flight_forwards`).
"""

from __future__ import annotations


def in_flight_forwards(pp: int, interleave: int, micro_batches: int, stage: int) -> int:
    """Chunk forwards (one model chunk, one micro batch) whose activations `stage` holds at its peak.

    Without interleave, 1F1B: min(p - k, m) micro batches of the whole stage. Interleaved 1F1B
    (Narayanan et al. 2021, §2.2.2; Megatron-LM's forward_backward_pipelining_with_interleaving): stage
    k runs 2(p - k - 1) + (v - 1)p warm-up chunk forwards, then one more before its first backward,
    so it holds min(2(p - k - 1) + (v - 1)p + 1, v·m) of them; the first stage v·p + p - 1, i.e.
    p·(1 + (p - 1)/(p·v)) micro batches' worth of its layers when chunks are even (Korthikanti et al.
    2022, §4.2.3)."""
    if interleave == 1:
        return min(pp - stage, micro_batches) if pp > 1 else 1
    return min(2 * (pp - stage - 1) + (interleave - 1) * pp + 1, interleave * micro_batches)


def chunk_forwards(pp: int, interleave: int, forwards: int) -> list[int]:
    """How many of a stage's first `forwards` forwards run each model chunk under interleaved 1F1B: groups of p
    micro batches run chunk 0, then chunk 1, ... (Megatron's get_model_chunk_id: the k-th forward, from 0, runs
    chunk k // p mod v), so every round of p x v forwards runs each chunk p times, a last partial round its
    first chunks."""
    rounds, rest = divmod(forwards, pp * interleave)
    return [rounds * pp + min(pp, max(0, rest - c * pp)) for c in range(interleave)]


def pipeline_sends(pp: int, interleave: int, stage: int) -> int:
    """Stage-boundary sends of one stage per micro batch (activations forward, gradients back). Each of
    its v chunks sends its output to the next stage and its input gradient to the previous one, except
    the model's first chunk (stage 0, chunk 0: nothing to send back) and its last (stage p-1, chunk v-1:
    the loss): 2v - [k = 0] - [k = p-1]; v = 1 gives 1 at the ends, 2 in the middle."""
    return 2 * interleave - (stage == 0) - (stage == pp - 1)


def bubble_fraction(pp: int, interleave: int, micro_batches: int) -> float:
    """Idle share of the ideal step: (p-1)/m for 1F1B, (p-1)/(v·m) interleaved (Narayanan et al. 2021, §2.2)."""
    return (pp - 1) / (interleave * micro_batches)
