"""reasoning-gym task pack for furlong: a ``data_source`` that generates seeded tasks by name
and a ``reward`` that grades each answer with the task's own verifier.

reasoning-gym (open-thought/reasoning-gym, Stojanovski et al. 2025) holds about a hundred
procedural task generators (arithmetic, logic, puzzles, graphs, ciphers...), each with a
``score_answer`` verifier. Both hooks live in this one plugin, named ``reasoning_gym``::

    furlong train --data-source reasoning_gym --rm-type reasoning_gym \\
        --reasoning-gym-tasks chain_sum basic_arithmetic --reasoning-gym-size 500 --reasoning-gym-seed 1 \\
        --eval-prompt-data rg chain_sum,basic_arithmetic ...
"""

from __future__ import annotations

import difflib
import functools
import json

from furlong.hooks import DatasetSpec, PluginError, RunConfig, hookimpl
from furlong.kit.answers import last_boxed_content, stated_answer
from furlong.kit.epochs import EpochOrder

__all__ = ["ReasoningGymSource", "add_arguments", "configure", "data_source", "extract_answer", "reward"]

PLUGIN = "reasoning_gym"
"""The plugin's name: its section of the run configuration."""

META_KEY = "reasoning_gym"
"""``Sample.metadata[META_KEY]`` = ``{"task", "seed", "size", "index"}``: where the reward finds the task entry."""


@hookimpl
def add_arguments(parser):
    group = parser.add_argument_group("reasoning_gym (data source and reward)")
    group.add_argument("--reasoning-gym-tasks", nargs="+", metavar="TASK",
                       help="reasoning-gym task names to generate training prompts from (e.g. chain_sum "
                            "basic_arithmetic); the rows interleave the tasks one by one")
    group.add_argument("--reasoning-gym-size", type=int, default=1000, metavar="N",
                       help="tasks generated per task name for training (default 1000); epochs repeat them")
    group.add_argument("--reasoning-gym-seed", type=int, default=0,
                       help="seed of the training task generators (default 0): the same seed gives the same tasks")
    group.add_argument("--reasoning-gym-eval-size", type=int, default=50, metavar="N",
                       help="tasks per task name of each eval set given as --eval-prompt-data NAME TASK[,TASK...] "
                            "(default 50)")
    group.add_argument("--reasoning-gym-eval-seed", type=int, default=None,
                       help="seed of the eval task generators (default --reasoning-gym-seed + 1)")
    group.add_argument("--reasoning-gym-system-prompt", default="default",
                       help="reasoning-gym system prompt put before each question (a key of "
                            "reasoning_gym.utils.SYSTEM_PROMPTS, default 'default', which asks for "
                            "<answer></answer> tags), or 'none'")


@hookimpl
def configure(args, report):
    """Check the task names, counts and system prompt before any model loads."""
    as_source = "--data-source" in report.flags
    if as_source and not args.reasoning_gym_tasks:
        report.error("--data-source reasoning_gym needs --reasoning-gym-tasks TASK [TASK ...] (e.g. chain_sum).")
    if as_source and args.prompt_data:
        report.error(f"--data-source reasoning_gym generates its prompts; --prompt-data {args.prompt_data} would "
                     "not be read. Drop it, or use --data-source jsonl.")
    for task in args.reasoning_gym_tasks or ():
        problem = _unknown_task(task)
        if problem:
            report.error(f"--reasoning-gym-tasks: {problem}")
    for flag, value in (("--reasoning-gym-size", args.reasoning_gym_size),
                        ("--reasoning-gym-eval-size", args.reasoning_gym_eval_size)):
        if value < 1:
            report.error(f"{flag} must be at least 1, got {value}.")
    prompts = _system_prompts()
    if args.reasoning_gym_system_prompt != "none" and args.reasoning_gym_system_prompt not in prompts:
        report.error(f"--reasoning-gym-system-prompt {args.reasoning_gym_system_prompt!r} is not one of "
                     f"{', '.join(sorted(prompts))} or 'none'.")


@hookimpl
def data_source(config, dataset):
    """Generate the prompts: ``--reasoning-gym-tasks`` for training; for an eval set
    (``--eval-prompt-data NAME TASK[,TASK...]``) the task names are its path.

    :raises PluginError: an unknown task name (with the closest names), or a task whose
        generator rejects its default configuration.
    """
    own = config.plugin_config(PLUGIN)
    if dataset.evaluation:
        tasks = [t.strip() for t in str(dataset.path).split(",") if t.strip()]
        seed = own.reasoning_gym_eval_seed
        seed = own.reasoning_gym_seed + 1 if seed is None else seed
        return ReasoningGymSource(tasks, own.reasoning_gym_eval_size, seed, config, dataset, flag=dataset.flag)
    return ReasoningGymSource(list(own.reasoning_gym_tasks or ()), own.reasoning_gym_size, own.reasoning_gym_seed,
                              config, dataset, flag="--reasoning-gym-tasks")


@hookimpl
def reward(config, samples):
    """Score each sample with its task's own verifier (``dataset.score_answer``).

    The answer is the content of the response's last ``<answer>...</answer>`` tag (what
    reasoning-gym's system prompt asks for), else of its last ``\\boxed{}``, else the answer
    it states (``Answer: X``, ``the answer is X``); none gives the verifier ``None`` (0).

    :param samples: samples from the ``reasoning_gym`` data source (their
        ``metadata["reasoning_gym"]`` locates the task entry).
    :returns: one float per sample in [0, 1], the verifier's score (partial credit where a
        task gives it).
    :raises PluginError: a sample without ``metadata["reasoning_gym"]`` (its prompt came
        from another data source).
    """
    scores = []
    for sample in samples:
        where = (sample.metadata or {}).get(META_KEY)
        if not isinstance(where, dict):
            raise PluginError(f"reward 'reasoning_gym': sample {sample.index} has no metadata['{META_KEY}']; this "
                              "reward grades prompts of --data-source reasoning_gym only.")
        dataset = _dataset(where["task"], int(where["size"]), int(where["seed"]))
        entry = dataset[int(where["index"])]
        scores.append(float(dataset.score_answer(answer=extract_answer(sample.response or ""), entry=entry)))
    return scores


def extract_answer(response: str) -> str | None:
    """The answer of a response: last ``<answer>`` tag, else last ``\\boxed{}``, else a stated answer."""
    from reasoning_gym.utils import extract_answer as tagged

    for found in (tagged(response, tag_name="answer"), last_boxed_content(response), stated_answer(response)):
        if found is not None:
            return found.strip()
    return None


class ReasoningGymSource:
    """Rows of generated tasks, the task names interleaved, in epoch order (shuffled per epoch
    with ``spec.seed + epoch`` when ``spec.shuffle``: ``--rollout-seed`` and ``--rollout-shuffle``
    for the training data, like the ``jsonl`` source).

    Rows are ``{"prompt", "label", "metadata"}``: the prompt is the system prompt and the
    question (rendered with the chat template under ``--apply-chat-template``), the label the
    task's reference answer, ``metadata["reasoning_gym"]`` the entry's task, seed, size and
    index.
    """

    def __init__(self, tasks: list[str], size: int, seed: int, config: RunConfig, spec: DatasetSpec,
                 flag: str):
        if not tasks:
            raise PluginError(f"{flag}: no reasoning-gym task names given.")
        for task in tasks:
            problem = _unknown_task(task)
            if problem:
                raise PluginError(f"{flag}: {problem}")
        self.config = config
        self.rows = []
        datasets = [(task, _dataset(task, size, seed)) for task in tasks]
        for index in range(size):
            for task, dataset in datasets:
                entry = dataset[index]
                self.rows.append({"prompt": self._prompt(entry["question"]), "label": entry["answer"],
                                  "metadata": {META_KEY: {"task": task, "seed": seed, "size": size, "index": index}}})
        self.cursor = EpochOrder(len(self.rows), spec.shuffle, spec.seed)

    def __len__(self) -> int:
        return len(self.rows)

    def next_rows(self, k: int) -> list[dict]:
        """The next ``k`` rows (copies); past the last row the next epoch starts."""
        return [json.loads(json.dumps(self.rows[i])) for i in self.cursor.take(k)]

    def state(self) -> dict:
        return self.cursor.state()

    def load_state(self, state: dict) -> None:
        self.cursor.load_state(state)

    def _prompt(self, question: str) -> str:
        key = self.config.plugin_config(PLUGIN).reasoning_gym_system_prompt
        system = None if key == "none" else _system_prompts()[key]
        if self.config.apply_chat_template:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": question}]
            return _tokenizer(self.config.hf_checkpoint).apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)
        return f"{system}\n\n{question}\n" if system else question


@functools.lru_cache(maxsize=64)
def _dataset(task: str, size: int, seed: int):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed)
    except Exception as exc:  # noqa: BLE001 - generators validate their configs with many types
        raise PluginError(f"reasoning-gym task {task!r} (size {size}, seed {seed}) failed to build: "
                          f"{type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from furlong.kit.hf import load_tokenizer

    return load_tokenizer(path)


def _task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _unknown_task(task: str) -> str | None:
    names = _task_names()
    if task in names:
        return None
    close = difflib.get_close_matches(task, names, n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"{len(names)} tasks exist, e.g. {', '.join(names[:8])}"
    return f"unknown reasoning-gym task {task!r} ({hint})"


def _system_prompts() -> dict:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return dict(SYSTEM_PROMPTS)
