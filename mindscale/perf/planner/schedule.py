"""The pipeline schedule: the forwards a stage holds in flight, its stage-boundary sends and the bubble.

Under 1F1B stage k holds ``p - k`` micro batches in flight (stage 0 holds p). Interleaved 1F1B with v chunks per
stage follows MindSpore 2.9's `InterleavedScheduler` (the `1f1b` pipeline_scheduler with pipeline_interleave), which
orders the chunks as Megatron-LM does (Narayanan et al. 2021, §2.2.2) when p divides m and otherwise runs the
first ``p + m mod p`` micro batches of each chunk as one round: stage k holds
``min((p + m mod p)(v-1) + 2(p-k-1) + 1, v·m)`` chunk forwards, stage 0 ``v·p + p - 1`` when p divides m
(`in_flight_forwards`; read from the compiled graph's execution order: docs/planner.md).
"""

from __future__ import annotations

# MindSpore 2.9 compiles a pipelined step as one kernel graph only where it calls the reused layer graph at most this
# many times (micro batches x chunks); beyond, each call is a graph of its own and the runtime, not SOMAS, allocates
# the activations between them (docs/planner.md, "One kernel graph or many").
ONE_GRAPH_CALLS = 64


def layer_graph_calls(pp: int, interleave: int, micro_batches: int) -> int:
    """Calls of the reused layer graph in one step of a pipeline (0 without stages: nothing is reused so)."""
    return micro_batches * interleave if pp > 1 else 0


def first_round(pp: int, micro_batches: int) -> int:
    """Micro batches each chunk runs in the interleaved schedule's first round: p, plus the m mod p that do not
    fill a round of their own (MindSpore's scheduler gives them to the first)."""
    return pp + micro_batches % pp


def in_flight_forwards(pp: int, interleave: int, micro_batches: int, stage: int) -> int:
    """Chunk forwards (one model chunk, one micro batch) whose activations `stage` holds at its peak.

    Without interleave, 1F1B: min(p - k, m) micro batches of the whole stage. Interleaved 1F1B: stage k runs
    (p + m mod p)(v - 1) + 2(p - k - 1) warm-up chunk forwards (its whole first round of every chunk but the
    last, and the forwards the later stages need to start), then one more before its first backward, so it
    holds min((p + m mod p)(v - 1) + 2(p - k - 1) + 1, v·m) of them; with p | m the first stage holds
    v·p + p - 1, i.e. p·(1 + (p - 1)/(p·v)) micro batches' worth of its layers when chunks are even
    (Korthikanti et al. 2022, §4.2.3). The count does not grow with m beyond m mod p."""
    if interleave == 1:
        return min(pp - stage, micro_batches) if pp > 1 else 1
    warm_up = first_round(pp, micro_batches) * (interleave - 1) + 2 * (pp - stage - 1)
    return min(warm_up + 1, interleave * micro_batches)


def chunk_forwards(pp: int, interleave: int, forwards: int, micro_batches: int | None = None) -> list[int]:
    """How many of a stage's first `forwards` forwards run each model chunk under interleaved 1F1B: the first
    round runs p + m mod p micro batches of chunk 0, then as many of chunk 1, ...; every later round p of each
    (a last partial round its first chunks). Without `micro_batches` p divides m (Megatron's get_model_chunk_id:
    the k-th forward, from 0, runs chunk k // p mod v)."""
    first = first_round(pp, micro_batches) if micro_batches else pp
    counts = [min(first, max(0, forwards - c * first)) for c in range(interleave)]
    rounds, rest = divmod(max(0, forwards - first * interleave), pp * interleave)
    return [n + rounds * pp + min(pp, max(0, rest - c * pp)) for c, n in enumerate(counts)]


def pipeline_sends(pp: int, interleave: int, stage: int) -> int:
    """Stage-boundary sends of one stage per micro batch (activations forward, gradients back). Each of
    its v chunks sends its output to the next stage and its input gradient to the previous one, except
    the model's first chunk (stage 0, chunk 0: nothing to send back) and its last (stage p-1, chunk v-1:
    the loss): 2v - [k = 0] - [k = p-1]; v = 1 gives 1 at the ends, 2 in the middle."""
    return 2 * interleave - (stage == 0) - (stage == pp - 1)


def bubble_fraction(pp: int, interleave: int, micro_batches: int) -> float:
    """Idle share of the ideal step: (p-1)/m for 1F1B, (p-1)/(v·m) interleaved (Narayanan et al. 2021, §2.2)."""
    return (pp - 1) / (interleave * micro_batches)
