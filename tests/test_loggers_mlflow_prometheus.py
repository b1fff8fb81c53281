"""The MLflow and Prometheus logger plugins, driven through the real plugin manager and read back: MLflow from a
real local tracking store with MLflow's own client, Prometheus by scraping ``/metrics`` over HTTP."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest

from furlong.builtin_plugins.loggers.mlflow_logger import metric_key, tracking_uri
from furlong.builtin_plugins.loggers.prometheus_logger import gauge_name, stop_servers
from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError

BASE = ["--hf-checkpoint", "model", "--prompt-data", "train.jsonl", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2"]  # S = 2


def _config(pm, *extra):
    return launch_config(*BASE, *extra, pm=pm, configure=False)


def _events(pm, config, with_eval: bool = True) -> None:
    """A 2-rollout run's observer calls: step t has loss 0.1 t; rollout r raw_reward 0.25 + 0.5 r and
    pass@2 0.5 + 0.25 r; with ``with_eval`` an evaluation after each rollout with eval/test 0.125 + 0.25 r."""
    async def calls():
        for r in range(2):
            for s in range(2):
                await pm.notify("on_train_step_end", config=config, rollout_id=r, step=2 * r + s,
                                metrics={"train/loss": 0.1 * (2 * r + s)})
            await pm.notify("on_rollout_end", config=config, rollout_id=r,
                            metrics={"rollout/raw_reward": 0.25 + 0.5 * r, "passrate/pass@2": 0.5 + 0.25 * r,
                                     "train/loss": 0.1 * (2 * r + 1), "rollout/entropy": None})
            if with_eval:
                await pm.notify("on_eval_end", config=config, rollout_id=r, metrics={"eval/test": 0.125 + 0.25 * r})

    asyncio.run(calls())


# --- MLflow ------------------------------------------------------------------------------------------------------


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, round(m.value, 6)) for m in client.get_metric_history(run_id, key))


def test_mlflow_logs_every_metric_at_its_step_into_a_local_file_store(tmp_path, plugin_manager, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = _config(plugin_manager, "--use-mlflow", "--save", str(tmp_path / "run"), "--mlflow-experiment-name",
                     "exp", "--mlflow-run-name", "first", "--eval-interval", "1", "--eval-prompt-data", "test",
                     "test.jsonl")
    assert tracking_uri(config) == f"file://{tmp_path}/run/mlruns"
    _events(plugin_manager, config)
    client = MlflowClient(tracking_uri=f"file://{tmp_path}/run/mlruns")
    [run] = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    run_id = run.info.run_id
    assert (run.info.run_name, run.info.status) == ("first", "FINISHED")  # finished after the last evaluation
    assert _history(client, run_id, "train/loss") == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)]
    assert _history(client, run_id, "rollout/raw_reward") == [(0, 0.25), (1, 0.75)]
    assert _history(client, run_id, "passrate/pass_2") == [(0, 0.5), (1, 0.75)]
    assert _history(client, run_id, "eval/test") == [(0, 0.125), (1, 0.375)]
    assert "rollout/entropy" not in run.data.metrics
    assert (run.data.params["n_samples_per_prompt"], run.data.params["mlflow_experiment_name"]) == ("2", "exp")
    assert "wandb_key" not in run.data.params


def test_mlflow_run_id_continues_an_existing_run(tmp_path, plugin_manager):
    from mlflow.tracking import MlflowClient

    uri = f"file://{tmp_path}/store"
    first = _config(plugin_manager, "--use-mlflow", "--mlflow-tracking-uri", uri)
    _events(plugin_manager, first, with_eval=False)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("furlong").experiment_id])
    again = _config(plugin_manager, "--use-mlflow", "--mlflow-tracking-uri", uri, "--mlflow-run-id", run.info.run_id,
                    "--num-rollout", "3")
    asyncio.run(plugin_manager.notify("on_rollout_end", config=again, rollout_id=2,
                                      metrics={"rollout/raw_reward": 2.0}))
    assert _history(client, run.info.run_id, "rollout/raw_reward") == [(0, 0.25), (1, 0.75), (2, 2.0)]


def test_mlflow_does_nothing_unless_enabled(tmp_path, plugin_manager):
    _events(plugin_manager, _config(plugin_manager, "--save", str(tmp_path / "run")), with_eval=False)
    assert not (tmp_path / "run" / "mlruns").exists()


def test_mlflow_missing_package_is_a_plugin_error_naming_the_install(tmp_path, plugin_manager, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name.startswith("mlflow"):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    config = _config(plugin_manager, "--use-mlflow", "--save", str(tmp_path))
    with pytest.raises(PluginError, match=r'--use-mlflow needs the MLflow client .*pip install "furlong\[mlflow\]"'):
        plugin_manager.get_plugin("mlflow").on_rollout_end(config=config, rollout_id=0, metrics={"a": 1.0})


def test_metric_keys_keep_what_mlflow_accepts():
    assert metric_key("passrate/pass@4") == "passrate/pass_4"
    assert metric_key("eval/aime-truncated_ratio") == "eval/aime-truncated_ratio"


# --- Prometheus --------------------------------------------------------------------------------------------------


@pytest.fixture
def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port
    stop_servers()


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_serves_the_latest_value_of_every_metric(plugin_manager, free_port):
    config = _config(plugin_manager, "--use-prometheus", "--prometheus-port", str(free_port), "--wandb-group", "g1")
    _events(plugin_manager, config, with_eval=True)
    label = (("run_name", "g1"),)
    scraped = _scrape(free_port)
    assert scraped[("furlong_rollout_raw_reward", label)] == 0.75
    assert scraped[("furlong_passrate_pass_at_2", label)] == 0.75
    assert scraped[("furlong_train_loss", label)] == pytest.approx(0.3)
    assert scraped[("furlong_eval_test", label)] == 0.375
    assert (scraped[("furlong_rollout_id", label)], scraped[("furlong_train_step", label)]) == (1.0, 3.0)
    assert not any(name == "furlong_rollout_entropy" for name, _ in scraped)


def test_prometheus_run_name_labels_the_gauges(plugin_manager, free_port):
    config = _config(plugin_manager, "--use-prometheus", "--prometheus-port", str(free_port),
                     "--prometheus-run-name", "mine")
    asyncio.run(plugin_manager.notify("on_rollout_end", config=config, rollout_id=0, metrics={"rollout/x": 3.0}))
    assert _scrape(free_port)[("furlong_rollout_x", (("run_name", "mine"),))] == 3.0


def test_prometheus_port_in_use_is_a_plugin_error_naming_the_flag(plugin_manager):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = _config(plugin_manager, "--use-prometheus", "--prometheus-port", str(port))
        with pytest.raises(PluginError, match=rf"--use-prometheus: cannot serve metrics on port {port} "
                                              r"\(--prometheus-port\)"):
            plugin_manager.get_plugin("prometheus").on_rollout_end(config=config, rollout_id=0, metrics={"a": 1.0})


def test_gauge_names_are_valid_prometheus_names():
    assert gauge_name("eval/aime-pass@16") == "furlong_eval_aime_pass_at_16"
    assert gauge_name("perf/rollout_time") == "furlong_perf_rollout_time"
