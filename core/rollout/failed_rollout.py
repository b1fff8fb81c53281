"""The samples of a rollout or an evaluation that failed, written where the user looks first."""

from __future__ import annotations

import json
import os

from furlong.hooks import RunConfig, Sample

__all__ = ["dump_failed_rollout"]


def dump_failed_rollout(config: RunConfig, rollout_id: int, groups: list[list[Sample]], what: str = "rollout") -> str:
    """Write every sample of ``groups`` as one JSON line to ``failed_<what>_<rollout_id>.jsonl`` (``what``:
    ``rollout``, or ``eval`` for the evaluation at ``rollout_id``).

    The folder is ``--save``, else ``--log-dir``, else the working directory (created if missing).

    :returns: the file's path.
    """
    folder = config.save or config.log_dir or os.getcwd()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"failed_{what}_{rollout_id}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for group in groups:
            for sample in group:
                f.write(json.dumps(sample.to_dict(), default=str) + "\n")
    return path
