"""Checkpoint cadence, crash-safe save order and the resume point (docs/checkpoints.md).

Layout under ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt   # rollout id of the newest complete checkpoint
    DIR/iter_0000004/                       # weights etc. *after* training on rollout 4
    DIR/iter_0000004/writer.json            # {"train_backend": name} of the backend that wrote it
    DIR/rollout/state_4.json                # data source, cursor, buffer, counters (JSON)
    DIR_critic/iter_0000004/                # the critic after rollout 4 (runs that train one; --critic-save)
    DIR_critic/latest_checkpointed_iteration.txt

A save writes ``iter_N.tmp/``, renames it to ``iter_N/``, writes the state JSON, and only
then replaces the marker (write a temp file, ``os.replace``), so a crash at any point
leaves the previous marker and everything it points to intact. The training loop calls
:func:`should_save`, :func:`save_checkpoint` and :func:`resolve_start`; the train backend
only writes into the directory it is given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
from typing import Any, Awaitable, Callable

import attrs

from furlong.hooks import PluginError, RunConfig


__all__ = [
    "MARKER_NAME",
    "WRITER_NAME",
    "ResumePoint",
    "critic_checkpoint",
    "iter_dir",
    "periodic",
    "post_save_hook",
    "read_marker",
    "resolve_start",
    "retire_previous",
    "retired",
    "save_checkpoint",
    "should_save",
    "state_path",
]

log = logging.getLogger("furlong.checkpoints")

MARKER_NAME = "latest_checkpointed_iteration.txt"
WRITER_NAME = "writer.json"
_TMP_SUFFIX = ".tmp"
_OLD_SUFFIX = ".old"


def periodic(r: int, k: int | None, last: int | None = None, epoch: int | None = None) -> bool:
    """Whether rollout ``r`` is on a cadence of every ``k`` rollouts.

    False when ``k`` is None; True when ``r == last - 1`` (the final rollout of a run of
    ``last`` rollouts; pass ``last=None`` for a cadence without a forced final point), or
    at the end of an epoch of ``epoch`` rollouts (``--num-epoch`` runs, as Miles);
    otherwise ``(r + 1) % k == 0``, so ``k=100`` fires at r = 99, 199, ...

    :param r: 0-based rollout id.
    :param k: interval in rollouts (``--save-interval``, ``--eval-interval``), or None.
    :param last: number of rollouts in the run (``--num-rollout``), or None.
    :param epoch: rollouts per epoch (``config.num_rollout_per_epoch``), or None.
    :raises ValueError: ``k`` is not positive.
    """
    if k is None:
        return False
    if k <= 0:
        raise ValueError(f"interval must be a positive number of rollouts, got {k}")
    if last is not None and r == last - 1:
        return True
    return (r + 1) % k == 0 or bool(epoch and (r + 1) % epoch == 0)


def should_save(config: RunConfig, rollout_id: int) -> bool:
    """Whether the loop saves after training on ``rollout_id``.

    True when ``config.save`` is set and either the cadence fires
    (``periodic(rollout_id, config.save_interval, config.num_rollout, config.num_rollout_per_epoch)``) or the file
    ``config.save_trigger_sentinel`` exists. ``--save-interval`` without ``--save`` is a
    config error raised at validation, not here.
    """
    if not config.save:
        return False
    if periodic(rollout_id, config.save_interval, config.num_rollout,
                config.num_rollout_per_epoch):
        return True
    sentinel = config.save_trigger_sentinel
    return bool(sentinel) and os.path.exists(sentinel)


def iter_dir(save: str, rollout_id: int) -> str:
    """``<save>/iter_<rollout_id:07d>``: the checkpoint holding the state after ``rollout_id``."""
    return os.path.join(save, f"iter_{rollout_id:07d}")


def state_path(save: str, rollout_id: int) -> str:
    """``<save>/rollout/state_<rollout_id>.json``: data-side state saved with ``iter_<rollout_id>``."""
    return os.path.join(save, "rollout", f"state_{rollout_id}.json")


def _fsync_dir(path: str) -> None:
    """Flush a directory entry to disk so a rename in it survives a power loss (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new content, never a mix."""
    tmp = path + _TMP_SUFFIX
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


async def save_checkpoint(
    config: RunConfig,
    rollout_id: int,
    save_model: Callable[[str], Awaitable[Any]],
    state: dict,
    save_hf: Callable[[str], Awaitable[Any]] | None = None,
    post_save: Callable[[str, str | None], Awaitable[Any]] | None = None,
    save_critic: Callable[[str], Awaitable[Any]] | None = None,
    keep: str | None = None,
) -> str:
    """Save the checkpoint of ``rollout_id`` under ``config.save``; return its final directory.

    Order: remove a stale ``iter_N.tmp/``; ``await save_model(tmp)``
    (the train backend writes weights, optimizer, scheduler, RNG into it, every rank
    finished when it returns); rename ``iter_N.tmp`` to ``iter_N`` (an existing
    ``iter_N`` is moved aside to ``iter_N.old`` first and deleted afterwards; ``iter_N/writer.json``
    records ``--train-backend``); write
    ``rollout/state_N.json`` atomically; replace the marker atomically with ``N``; delete
    ``config.save_trigger_sentinel`` if it exists. If anything raises before the marker is
    replaced, the previous marker and the checkpoint it names stay valid.

    ``state`` is serialized to JSON before ``save_model`` is awaited, so later mutation by
    the caller (train-async drawing the next batch) does not leak into this checkpoint.

    :param config: needs ``save``; reads ``save_trigger_sentinel`` if present.
    :param rollout_id: rollout just trained on.
    :param save_model: coroutine function writing the model state into the given path;
        the train group's ``save_model``, which returns once every train rank wrote its
        part (the driver alone renames, writes the state JSON and the marker).
    :param state: JSON-serializable dict (data-source state, cursor counters, buffer of
        groups as ``Sample.to_dict()`` lists, sample counters), built by the caller.
    :param save_hf: coroutine function writing a Hugging Face export into the given path
        (the train group's ``save_hf``); with ``--save-hf TEMPLATE`` it is awaited after the
        marker names the new checkpoint, into ``TEMPLATE.format(rollout_id=N)``, before the
        post-save hook (which gets that directory as ``hf_dir``).
    :param post_save: coroutine function ``post_save(ckpt_dir, hf_dir)`` awaited last, once the
        marker names the checkpoint and the export is written (the run's
        ``--custom-megatron-post-save-hook-path``, through the plugin manager), or None.
    :param save_critic: coroutine function writing the critic into the given path (the critic
        group's ``save_model``), or None: after the actor's ``save_model`` it writes
        ``<config.critic_save>/iter_N`` the same crash-safe way, with that folder's own marker,
        before the run's marker names rollout N (so a checkpoint the marker names always has
        its critic).
    :param keep: the ``iter_*`` folder this run resumed from, which ``--save-retain-interval`` never
        deletes (:func:`retire_previous`), or None.
    :returns: ``<save>/iter_<rollout_id:07d>``.
    :raises PluginError: ``config.save`` is not set, or ``state`` is not JSON-serializable.
    """
    save = config.save
    if not save:
        raise PluginError("save_checkpoint needs --save DIR: pass the directory checkpoints go to.")
    state_text = _state_json(state, rollout_id)
    final = iter_dir(save, rollout_id)
    tmp = final + _TMP_SUFFIX
    os.makedirs(save, exist_ok=True)
    if os.path.lexists(tmp):
        log.info("removing stale partial checkpoint %s", tmp)
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    await save_model(tmp)
    with open(os.path.join(tmp, WRITER_NAME), "w", encoding="utf-8") as f:
        json.dump({"train_backend": config.train_backend}, f)
    _fsync_dir(tmp)
    if save_critic is not None:
        await _save_critic(config, rollout_id, save_critic)
    previous = read_marker(save)
    _publish(config, save, rollout_id, tmp, final, state_text)
    await retire_previous(config, previous, rollout_id, keep)
    hf_dir = hf_export_dir(config, rollout_id)
    if hf_dir:
        await save_hf(hf_dir)
        log.info("saved Hugging Face weights %s", hf_dir)
    if post_save is not None:
        await post_save(final, hf_dir)
    return final


def retired(previous: int | None, rollout_id: int, retain: int | None) -> bool:
    """Whether the checkpoint of rollout ``previous`` (the one the marker named before ``rollout_id``
    was saved) is deleted under ``--save-retain-interval retain``.

    Megatron-LM's rule (``megatron/training/checkpointing.py``, ``save_checkpoint``: after the
    tracker names the new iteration, the one it named before is deleted when it is above 0, is not
    the new one and is not a multiple of the interval): every save looks only at the checkpoint
    saved before it, so those at rollout 0 and at multiples of ``retain`` stay, and the newest.
    Example, ``--save-interval 1 --save-retain-interval 2`` over rollouts 0..4: 1 and 3 go, 0, 2 and 4 stay.
    """
    return retain is not None and previous is not None and 0 < previous != rollout_id and previous % retain != 0


async def retire_previous(config: RunConfig, previous: int | None, rollout_id: int, keep: str | None = None) -> None:
    """Delete the checkpoint of rollout ``previous`` when :func:`retired` says so: ``iter_<previous>``
    under ``--save``, its data state ``rollout/state_<previous>.json`` and the critic's
    ``iter_<previous>`` under ``--critic-save``.

    Only a folder this core wrote is deleted: a directory (not a link) holding ``writer.json``; the
    folder ``keep`` (the checkpoint the run resumed from) stays. The folder is first renamed to
    ``iter_<previous>.tmp`` (what a partial save is called), so a crash mid-delete leaves no
    half-deleted ``iter_*``. Runs off the event loop's thread (a large checkpoint takes a while).
    """
    retain = config.save_retain_interval
    if not retired(previous, rollout_id, retain):
        return
    folders = [config.save] + ([config.critic_save] if config.use_critic and config.critic_save else [])
    for save in folders:
        path = iter_dir(save, previous)
        if same_dir(path, keep):
            log.info("--save-retain-interval %d: keeping %s, the checkpoint this run resumed from", retain, path)
            return
    deleted = []
    for save in folders:
        path = iter_dir(save, previous)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) or not os.path.isfile(os.path.join(path, WRITER_NAME)):
            log.warning("--save-retain-interval %d: not deleting %s: it is a link or has no %s (not a checkpoint "
                        "furlong wrote)", retain, path, WRITER_NAME)
            continue
        await asyncio.to_thread(_delete_checkpoint, path)
        deleted.append(save)
        log.info("--save-retain-interval %d: deleted %s (rollout %d is not a multiple of %d)", retain, path,
                 previous, retain)
    state = state_path(config.save, previous)
    if config.save in deleted and os.path.isfile(state):  # the data state goes with its checkpoint only
        os.remove(state)


def _delete_checkpoint(path: str) -> None:
    """Rename ``iter_N`` to ``iter_N.tmp`` (a stale one removed first), then delete it."""
    tmp = path + _TMP_SUFFIX
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.rename(path, tmp)
    _fsync_dir(os.path.dirname(path))
    shutil.rmtree(tmp)


def hf_export_dir(config: RunConfig, rollout_id: int) -> str | None:
    """``--save-hf`` for this rollout (``{rollout_id}`` filled in), or None without the flag."""
    template = config.save_hf
    return template.format(rollout_id=rollout_id) if template else None


def _state_json(state: dict, rollout_id: int) -> str:
    try:
        return json.dumps(state, indent=1, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise PluginError(
            f"checkpoint of rollout {rollout_id}: the data state is not JSON-serializable ({exc}); "
            "data-source state() and buffered samples must hold only JSON types."
        ) from exc


async def _save_critic(config: RunConfig, rollout_id: int, save_model: Callable[[str], Awaitable[Any]]) -> None:
    """``<critic_save>/iter_N`` written as ``iter_N.tmp`` and renamed, then that folder's marker."""
    save = config.critic_save
    if not save:
        raise PluginError("a run that trains a critic saves it to --critic-save (default: --save + '_critic'); "
                          "pass --critic-save DIR.")
    final = iter_dir(save, rollout_id)
    tmp = final + _TMP_SUFFIX
    os.makedirs(save, exist_ok=True)
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    await save_model(tmp)
    with open(os.path.join(tmp, WRITER_NAME), "w", encoding="utf-8") as f:
        json.dump({"train_backend": config.train_backend, "role": "critic"}, f)
    _fsync_dir(tmp)
    _rename_into_place(save, tmp, final)
    _atomic_write_text(os.path.join(save, MARKER_NAME), str(rollout_id))
    log.info("saved critic checkpoint %s", final)


def _rename_into_place(save: str, tmp: str, final: str) -> None:
    """Rename the complete ``iter_N.tmp`` to ``iter_N`` (an existing one kept as ``iter_N.old`` until then)."""
    old = final + _OLD_SUFFIX
    if os.path.isdir(final):
        # iter_N already exists (a re-run of rollout N): keep it as iter_N.old until the
        # new one is in place, so a crash between the two renames can be recovered.
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save)
    if os.path.lexists(old):
        shutil.rmtree(old)


def _publish(config: RunConfig, save: str, rollout_id: int, tmp: str, final: str, state_text: str) -> None:
    """Rename the complete ``iter_N.tmp`` into place, write the state JSON, then the marker."""
    _rename_into_place(save, tmp, final)
    os.makedirs(os.path.dirname(state_path(save, rollout_id)), exist_ok=True)
    _atomic_write_text(state_path(save, rollout_id), state_text)
    _atomic_write_text(os.path.join(save, MARKER_NAME), str(rollout_id))

    sentinel = config.save_trigger_sentinel
    if sentinel and os.path.exists(sentinel):
        os.remove(sentinel)
        log.info("save trigger %s honoured at rollout %d and removed", sentinel, rollout_id)
    log.info("saved checkpoint %s", final)


def post_save_hook(config: RunConfig, pm: Any, selection: Any,
                   rollout_id: int) -> Callable[[str, str | None], Awaitable[None]] | None:
    """``--custom-megatron-post-save-hook-path`` as :func:`save_checkpoint`'s ``post_save``, or None without it.

    The hook is called through the plugin manager as ``hook(args, rollout_id, ckpt_dir, hf_dir)``
    (its adapter: :mod:`furlong.core.plugins.adapters`; ``args``: the configuration's Namespace view);
    it is a plain function.

    :param selection: the run's :class:`~furlong.core.plugins.selection.Selection` (``paths["post_save"]``).
    """
    choice = selection.paths.get("post_save")
    if choice is None:
        return None

    async def post_save(ckpt_dir: str, hf_dir: str | None) -> None:
        await pm.call_chosen("post_save", *choice, config=config, rollout_id=rollout_id, ckpt_dir=ckpt_dir,
                             hf_dir=hf_dir)
    return post_save


@attrs.define
class ResumePoint:
    """Where a run starts.

    ``start_rollout_id``: first rollout id to run. ``load_dir``: the ``iter_*`` directory to
    load weights, optimizer, scheduler and RNG from, or None for a warm start (weights from
    ``--ref-load`` / ``--hf-checkpoint``). ``state``: the data-side state dict saved with
    rollout ``start_rollout_id - 1``, or None (start the data source fresh).
    ``loaded_rollout_id``: the rollout id of ``load_dir``, or None.
    """

    start_rollout_id: int
    load_dir: str | None = None
    state: dict | None = None
    loaded_rollout_id: int | None = None


def same_dir(a: str | None, b: str | None) -> bool:
    """Whether two flag values name the same directory (both set)."""
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def read_marker(load: str) -> int | None:
    """The rollout id in ``<load>/latest_checkpointed_iteration.txt``, or None without one.

    :raises PluginError: the marker exists but does not hold an integer.
    """
    path = os.path.join(load, MARKER_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise PluginError(
            f"--load {load!r}: {path} holds {text!r}, not a rollout id; "
            "write the id of the newest complete iter_* directory into it, or delete it to warm-start."
        ) from None


def _check_writer(config: RunConfig, load_dir: str, loaded: int) -> None:
    """The checkpoint was written by this run's ``--train-backend`` (checkpoints without ``writer.json`` pass)."""
    try:
        with open(os.path.join(load_dir, WRITER_NAME), encoding="utf-8") as f:
            writer = json.load(f).get("train_backend")
    except (OSError, ValueError, AttributeError):
        return
    backend = config.train_backend
    if writer and backend and writer != backend:
        raise PluginError(f"--load {config.load}: {os.path.basename(load_dir)} was written by --train-backend "
                          f"{writer}, which this run's --train-backend {backend} cannot read; resume with "
                          f"--train-backend {writer} (or start another run without --load).")


def resolve_start(config: RunConfig) -> ResumePoint:
    """Decide the start rollout id, the checkpoint to load and the data state.

    With ``config.load`` holding the marker ``M``: weights from ``iter_<M>``, or from
    ``iter_<config.ckpt_step>`` when given (call that loaded id ``L``); start at ``L + 1``
    unless ``config.start_rollout_id`` is given; data state from
    ``<load>/rollout/state_<start - 1>.json`` (a missing file gives None and an info
    log). Without ``--load``, or with an empty or marker-less one: warm start at
    ``config.start_rollout_id`` if given, else 0. Examples: marker 7 ->
    start 8 with state 7; empty dir and ``--start-rollout-id 3`` -> 3; empty dir -> 0.

    An ``iter_<L>`` lost in the middle of replacing it with a re-save (only
    ``iter_<L>.old`` left) is loaded from ``iter_<L>.old`` with a warning.

    ``--finetune`` (Megatron-LM's: weights only, iteration 0): the same checkpoint is found, the
    backend loads its weights only (:func:`furlong.kit.resume.load_parts`), and the run starts at
    ``config.start_rollout_id`` if given, else 0, with no data state (the data from its start) and
    an info line saying so.

    :raises PluginError: ``--load`` holds no marker under ``--exit-on-missing-checkpoint``, the marker is not an
        integer, the checkpoint it (or
        ``--ckpt-step``) names does not exist (the message names the path), or its
        ``writer.json`` names another ``--train-backend`` than this run's (each backend
        reads only its own layout).
    """
    load = config.load
    start_override = config.start_rollout_id
    marker = read_marker(load) if load and os.path.isdir(load) else None

    iteration = re.fullmatch(r"iter_(\d+)(\.old)?", os.path.basename(os.path.normpath(load))) if load else None
    if marker is None and iteration:
        parent = os.path.dirname(os.path.normpath(load)) or "."
        raise PluginError(f"--load '{load}' is one checkpoint iteration; pass the directory that holds it: "
                          f"--load {parent} (add --ckpt-step {int(iteration[1])} to resume from this iteration).")
    if marker is None and load and config.exit_on_missing_checkpoint:
        raise PluginError(f"--load {load}: no checkpoint there (no {MARKER_NAME}) and --exit-on-missing-checkpoint "
                          "is given; point --load at a folder a run saved to, or drop --exit-on-missing-checkpoint "
                          "to start from the initial weights.")
    if marker is None:
        start = start_override if start_override is not None else 0
        if load and not os.path.isdir(load) and not same_dir(load, config.save):
            log.warning("--load %s does not exist: warm start from the initial weights at rollout %d", load, start)
        elif load:
            log.info("--load %s has no %s: warm start at rollout %d", load, MARKER_NAME, start)
        return ResumePoint(start_rollout_id=start)

    ckpt_step = config.ckpt_step
    loaded = ckpt_step if ckpt_step is not None else marker
    load_dir = iter_dir(load, loaded)
    if not os.path.isdir(load_dir):
        if os.path.isdir(load_dir + _OLD_SUFFIX):
            log.warning("%s is missing (a re-save was interrupted); loading %s", load_dir, load_dir + _OLD_SUFFIX)
            load_dir = load_dir + _OLD_SUFFIX
        else:
            source = f"--ckpt-step {ckpt_step}" if ckpt_step is not None else f"{MARKER_NAME} ({marker})"
            raise PluginError(
                f"--load {load!r}: {source} names checkpoint {load_dir}, which does not exist. "
                f"Point --load at the directory holding iter_* and {MARKER_NAME}, fix the marker, "
                "or pass --ckpt-step with an existing iteration."
            )

    _check_writer(config, load_dir, loaded)
    if config.finetune:
        start = start_override if start_override is not None else 0
        log.info("--finetune: loading the weights of %s only (fresh optimizer, learning-rate schedule and RNG); the "
                 "run starts at rollout %d with the data from its start", load_dir, start)
        return ResumePoint(start_rollout_id=start, load_dir=load_dir, loaded_rollout_id=loaded)
    start = start_override if start_override is not None else loaded + 1
    state = None
    if start > 0:
        path = state_path(load, start - 1)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            try:
                state = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PluginError(
                    f"{path}: not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno}); the data state of "
                    f"checkpoint {loaded} is damaged. Restore it, delete it to start the data source fresh, or "
                    "resume from an earlier checkpoint with --ckpt-step."
                ) from None
        else:
            log.info("no data state %s: the data source starts fresh", path)
    log.info("resuming from %s at rollout %d", load_dir, start)
    return ResumePoint(start_rollout_id=start, load_dir=load_dir, state=state, loaded_rollout_id=loaded)


def critic_checkpoint(config: RunConfig, resume: ResumePoint) -> str | None:
    """The critic ``iter_*`` folder a run that trains a critic loads, or None (the critic backend
    starts from ``--critic-load`` as a Hugging Face directory, or from ``--hf-checkpoint`` with a
    fresh value head).

    ``--critic-load`` holding a marker (a critic checkpoint folder): its ``iter_<L>`` where ``L`` is
    the rollout the actor resumes from, or its marker's when the actor starts fresh. Without a
    marker (a Hugging Face directory, an empty or missing folder): None; when the actor resumes,
    the critic then starts afresh, with a warning.

    :raises PluginError: the actor resumes from rollout ``L`` and the critic folder has a marker
        but no ``iter_<L>`` (the critic and the actor would not match).
    """
    load = config.critic_load
    marker = read_marker(load) if load and os.path.isdir(load) else None
    if marker is None:
        if resume.loaded_rollout_id is not None and not (load and os.path.isfile(os.path.join(load, "config.json"))):
            log.warning("the actor resumes from %s but --critic-load %s holds no critic checkpoint: the critic starts "
                        "afresh", resume.load_dir, load)
        return None
    loaded = resume.loaded_rollout_id if resume.loaded_rollout_id is not None else marker
    path = iter_dir(load, loaded)
    if not os.path.isdir(path):
        raise PluginError(f"--critic-load {load}: no {os.path.basename(path)}, the critic of rollout {loaded} the actor "
                          f"resumes from (its marker names {marker}); restore it, or point --critic-load at a Hugging "
                          "Face directory to start the critic afresh.")
    log.info("critic resumes from %s", path)
    return path
