"""A run resumed at or past ``--num-rollout`` says that nothing is left to train (it used to exit 0 in silence)."""

from __future__ import annotations


def test_resuming_a_finished_run_says_there_is_nothing_left_to_train(tmp_path, tiny_model_dir, arithmetic_jsonl,
                                                                     run_furlong):
    flags = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
             "--label-key", "label", "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
             "--global-batch-size", "4", "--rollout-max-response-len", "4", "--save", str(tmp_path / "run"),
             "--load", str(tmp_path / "run"), "--save-interval", "1"]
    first = run_furlong("train", *flags, "--num-rollout", "2", env={"OMP_NUM_THREADS": "1"})
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_furlong("train", *flags, "--num-rollout", "1", env={"OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert ("the run starts at rollout 2 and --num-rollout is 1: there is nothing left to train (a finished run "
            "resumed, or --num-rollout lowered); raise --num-rollout to train further.") in again.stderr
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
