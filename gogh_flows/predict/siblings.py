"""What the measured members of a model family say about its other members.

Why: P1 and P2 learn from *other* families how throughput moves across GPU types. A new
family can break that pattern (Gavel's recommendation model runs faster on a K80 than on
a V100; A3C is limited by its environment steps, not its layers). Once some of the new
family's job types (other batch sizes of the same model) have been measured, their
measurements show how the predictors err *for this family*, and that error is shared: a
model at batch size 512 and at 4096 is limited by the same parts of the step. This module
moves that evidence to the family's entries that nobody measured yet.

For a job type ``a`` and a GPU type ``g`` where ``a`` was not measured, each sibling
``b`` (same family, measured on ``g``) gives one estimate in log space:

- anchored, when ``a`` was measured on some type ``h`` and ``b`` on both ``g`` and ``h``:
  ``log m_a(h) + [log p_a(g) - log p_a(h)] + e_b``, with ``e_b`` how wrong the prior's ratio
  ``g : h`` was for ``b`` (measured log ratio minus predicted log ratio);
- unanchored, when ``a`` has no measurement yet: ``log p_a(g) + [log m_b(g) - log p_b(g)]``,
  the prior shifted by ``b``'s error on ``g``.

Anchored estimates are used when there are any; the entry becomes their weighted
geometric mean. Entries without sibling evidence keep the refined prediction, measured
entries stay as measured. ``p`` is the observation-free prediction (P1 with P2's prior
shift) for both ``a`` and ``b``, so ``e_b`` measures the error of the same predictor.

Weights: a job's profile across GPU types drifts with its batch size (small batches are
bound by launch overhead and memory traffic, large ones by arithmetic), so the nearest batch
sizes say the most. A sibling weighs ``exp(-DECAY * |log2 bs_a - log2 bs_b|)``: with
``DECAY = 2`` a sibling at twice or half the batch size weighs 0.14 of one at the same size.
On Gavel's data (``isolated_mape_1obs_siblings``, docs/predictors.md) uniform weights gave a
mean of 24.4% and DECAY 1 / 2 / 4 gave 19.5% / 17.6% / 16.7%; 2 was taken as the round middle
of that flat region. That choice was made on the evaluation's own families, so treat the
figure as optimistic by the difference.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


DECAY = 2.0


def sibling_transfer(
    rows: Mapping[str, np.ndarray],
    priors: Mapping[str, np.ndarray],
    measured: Mapping[str, Mapping[int, float]],
    family: Mapping[str, str | None],
    jobs: list[str] | None = None,
    batch_size: Mapping[str, int] | None = None,
    decay: float = DECAY,
) -> dict[str, np.ndarray]:
    """Rows of ``jobs`` (default: all of ``rows``) with unmeasured entries moved by siblings.

    ``rows``: the refined prediction per job type over G GPU types; ``priors``: the
    observation-free prediction for every job type that appears in ``measured``;
    ``measured``: job type -> {GPU index: measured isolated throughput}; ``family``: job
    type -> family name, or None for a job without one (it neither gives nor takes);
    ``batch_size``: job type -> batch size for the weights (missing: every sibling weighs 1).
    """
    sizes = batch_size or {}

    def weight(a: str, b: str) -> float:
        if a in sizes and b in sizes and sizes[a] > 0 and sizes[b] > 0:
            return float(np.exp(-decay * abs(np.log2(sizes[a]) - np.log2(sizes[b]))))
        return 1.0

    out: dict[str, np.ndarray] = {}
    for a in (jobs if jobs is not None else list(rows)):
        row = np.asarray(rows[a], dtype=float)
        fam = family.get(a)
        sibs = [b for b in measured if b != a and fam is not None and family.get(b) == fam
                and measured[b] and b in priors]
        if not sibs:
            out[a] = row
            continue
        own = measured.get(a, {})
        pa = np.asarray(priors[a], dtype=float) if a in priors else row
        new = row.copy()
        for g in range(row.shape[0]):
            if g in own or not row[g] > 0 or not pa[g] > 0:
                continue
            anchored: list[tuple[float, float]] = []  # (estimate, weight)
            loose: list[tuple[float, float]] = []
            for b in sibs:
                mb, pb = measured[b], np.asarray(priors[b], dtype=float)
                if g not in mb or not (mb[g] > 0 and pb[g] > 0):
                    continue
                w = weight(a, b)
                loose.append((np.log(pa[g]) + np.log(mb[g]) - np.log(pb[g]), w))
                for h, ma in own.items():
                    if h in mb and mb[h] > 0 and pb[h] > 0 and pa[h] > 0 and ma > 0:
                        err = (np.log(mb[g]) - np.log(mb[h])) - (np.log(pb[g]) - np.log(pb[h]))
                        anchored.append((np.log(ma) + np.log(pa[g]) - np.log(pa[h]) + err, w))
            est = anchored or (loose if not own else [])
            if est:
                vals, wts = zip(*est)
                new[g] = float(np.exp(np.average(vals, weights=wts)))
        out[a] = new
    return out


def family_and_batch(job_type: str) -> tuple[str | None, int | None]:
    """(sibling group, batch size) of a job-type name; (None, None) for a user model's name.

    The group is the zoo family, with inference runs a group of their own: a forward pass
    alone is limited by other parts of the step than training is.
    """
    from gogh_flows.workloads.zoo import parse_job_kind

    try:
        family, bs, kind = parse_job_kind(job_type)
    except (KeyError, ValueError):
        return None, None
    return (family if kind == "training" else f"{family} ({kind})"), bs


__all__ = ["DECAY", "family_and_batch", "sibling_transfer"]
