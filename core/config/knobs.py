"""The four-knob invariant: rollout_batch_size x n_samples_per_prompt =
global_batch_size x num_steps_per_rollout, and the data-parallel divisibility checks."""

from __future__ import annotations

__all__ = ["KNOBS", "dp_problems", "resolve_knobs"]

RBS, N, GBS, S = KNOBS = ("rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout")
FLAG = {k: "--" + k.replace("_", "-") for k in KNOBS}
RULE = "both sides must be equal"


def resolve_knobs(values: dict, given: set[str]) -> tuple[dict | None, str | None]:
    """Derive the knobs that were not given, or explain why that is impossible.

    Steps: a given knob must be a positive whole number; all four given
    must satisfy the equation; while fewer than three are known, ``n := 1`` then
    ``S := 1``; still fewer than three is an error (``--rollout-batch-size`` is
    required); the missing one is derived and must be a positive whole number.

    :param values: knob name -> value (values of knobs not in ``given`` are ignored).
    :param given: knob names passed explicitly.
    :returns: ``(knobs, None)`` with all four as ints, or ``(None, message)``; the
        message names all four knobs with their values (``?`` for an unknown one).
    """
    known = {k: values[k] for k in KNOBS if k in given}
    for k, v in known.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return None, f"{FLAG[k]} must be a positive whole number, got {v}: {_equation(_defaulted(known))}."
    if len(known) == 4:
        left, right = known[RBS] * known[N], known[GBS] * known[S]
        if left != right:
            return None, f"{_side(known, RBS, N)}, but {_side(known, GBS, S)}; {RULE}."
        return known, None
    known = _defaulted(known)
    if len(known) < 3:
        return None, (f"{FLAG[RBS]} is required: give the prompts per rollout (or {FLAG[GBS]}, the samples per "
                      f"optimizer step, from which it follows: {_equation(known)}).")
    (missing,) = [k for k in KNOBS if k not in known]
    num, den, what = _derivation(known, missing)
    if num % den == 0 and num // den >= 1:
        known[missing] = num // den
        return known, None
    return None, (f"{_equation(known)} has no whole solution with {FLAG[missing]} >= 1: "
                  f"{what} = {num / den:.4g}.")


def _defaulted(known: dict) -> dict:
    """``known`` with ``n := 1``, then ``S := 1``, while fewer than three knobs are known."""
    known = dict(known)
    for k in (N, S):
        if len(known) < 3 and k not in known:
            known[k] = 1
    return known


def _derivation(known: dict, missing: str) -> tuple[int, int, str]:
    """``(numerator, denominator, formula text)`` of the missing knob."""
    if missing in (GBS, S):
        num = known[RBS] * known[N]
        den, unit = (known[S], "steps per rollout") if missing == GBS else (known[GBS], "samples per step")
    else:
        num = known[GBS] * known[S]
        den, unit = (known[N], "samples per prompt") if missing == RBS else (known[RBS], "prompts per rollout")
    return num, den, f"{missing} = {num} samples per rollout / {den} {unit}"


def _value(known: dict, k: str) -> str:
    return str(known[k]) if k in known else "?"


def _equation(known: dict) -> str:
    return (f"{FLAG[RBS]} ({_value(known, RBS)}) x {FLAG[N]} ({_value(known, N)}) = "
            f"{FLAG[GBS]} ({_value(known, GBS)}) x {FLAG[S]} ({_value(known, S)})")


def _side(known: dict, a: str, b: str) -> str:
    return f"{FLAG[a]} ({known[a]}) x {FLAG[b]} ({known[b]}) = {known[a] * known[b]} samples per rollout"


def dp_problems(gbs: int, micro_batch_size: int, dynamic: bool, dp: int, dp_text: str) -> list[str]:
    """Step 4: every data-parallel rank gets the same whole number of (micro-)batches.

    :param dp: data-parallel size ``D``; ``dp_text`` says how it was computed.
    """
    if gbs % dp:
        return [f"{FLAG[GBS]} ({gbs}) must be divisible by the data-parallel size {dp} ({dp_text}): "
                f"every rank trains on the same number of samples per step."]
    per_rank = gbs // dp
    if not dynamic and per_rank % micro_batch_size:
        return [f"{FLAG[GBS]} ({gbs}) / data-parallel size {dp} = {per_rank} samples per rank per step is not a "
                f"multiple of --micro-batch-size ({micro_batch_size}); change one of them or use "
                f"--use-dynamic-batch-size."]
    return []
