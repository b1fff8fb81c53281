"""Eval dataset resolution: config format, inheritance chain, errors. A dataset's own stop
strings and min_new_tokens are kept, and an unknown key is an error, never ignored."""

import base64
import functools

import pytest
import yaml

from furlong.core.config.launch_args import launch_config
from furlong.core.config.eval_config import EvalDataset, load_eval_datasets, sampling_params
from furlong.hooks import PluginError

KNOWN = (
    "rm_type, input_key, label_key, tool_key, metadata_key, n_samples_per_eval_prompt, temperature, "
    "top_p, top_k, max_response_len, stop, stop_token_ids, min_new_tokens, custom_generate_function_path, "
    "metadata_overrides"
)


def _args(**kw):
    """The run configuration with the eval flags' defaults and ``kw``."""
    return _base_config().replace(**kw)


@functools.cache
def _base_config():
    base = dict(
        eval_config=None,
        eval_prompt_data=None,
        eval_temperature=None,
        eval_top_p=None,
        eval_top_k=None,
        eval_max_response_len=None,
        eval_input_key=None,
        eval_label_key=None,
        eval_tool_key=None,
        n_samples_per_eval_prompt=1,
        n_samples_per_prompt=8,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=1024,
        rollout_stop=["<|im_end|>"],
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        input_key="input",
        label_key="label",
        tool_key="tools",
        metadata_key="metadata",
    )
    return launch_config(configure=False, **base)


def _config(tmp_path, text):
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


C005_TYPO = """
eval:
  defaults:
    top_p: 0.9
    rm_type: math
    temprature: 0.6
  datasets:
    - name: alpha
      path: /data/alpha.jsonl
      stop: ["</answer>"]
      min_new_tokens: 8
    - name: beta
      path: /data/beta.jsonl
"""


def test_c005_unknown_default_key_is_named(tmp_path):
    path = _config(tmp_path, C005_TYPO)
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: unknown key 'temprature' in eval.defaults. Did you mean 'temperature'? "
        f"Known keys: {KNOWN}. Fix or remove it."
    )


def test_c005_after_fix_per_dataset_stop_and_min_new_tokens(tmp_path):
    path = _config(tmp_path, C005_TYPO.replace("temprature", "temperature"))
    alpha, beta = load_eval_datasets(_args(eval_config=path))
    assert (alpha.name, alpha.path) == ("alpha", "/data/alpha.jsonl")
    assert alpha.stop == ["</answer>"]
    assert alpha.min_new_tokens == 8
    assert alpha.top_p == 0.9
    assert alpha.temperature == 0.6
    assert alpha.rm_type == "math"
    assert beta.stop == ["<|im_end|>"]  # training fallback
    assert beta.min_new_tokens is None
    assert beta.top_p == 0.9
    assert beta.rm_type == "math"
    a_params = sampling_params(alpha, _args())
    b_params = sampling_params(beta, _args())
    assert a_params["stop"] == ["</answer>"] and a_params["min_new_tokens"] == 8 and a_params["top_p"] == 0.9
    assert b_params["stop"] == ["<|im_end|>"] and "min_new_tokens" not in b_params and b_params["top_p"] == 0.9


def test_unknown_dataset_key_names_key_and_dataset(tmp_path):
    path = _config(
        tmp_path,
        "eval:\n  datasets:\n    - {name: gsm, path: g.jsonl}\n    - {name: alpha, path: a.jsonl, stops: [x]}\n",
    )
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: unknown key 'stops' in dataset 'alpha' (eval.datasets[1]). Did you mean 'stop'? "
        f"Known keys: name, path, {KNOWN}. Fix or remove it."
    )


@pytest.mark.parametrize(
    ("field", "dataset", "defaults", "eval_flag", "rollout", "expected"),
    [
        # dataset entry -> eval defaults -> --eval-<field> -> rollout counterpart
        ("temperature", 0.1, 0.2, 0.3, 0.4, 0.1),
        ("temperature", None, 0.2, 0.3, 0.4, 0.2),
        ("temperature", None, None, 0.3, 0.4, 0.3),
        ("temperature", None, None, None, 0.4, 0.4),
        ("temperature", None, None, 0.0, 0.4, 0.0),  # 0 (greedy) is a value, not "unset"
        ("top_k", None, None, 20, -1, 20),
        ("max_response_len", None, 512, 256, 1024, 512),
        ("max_response_len", None, None, None, 1024, 1024),
        ("input_key", None, None, "question", "input", "question"),
        ("label_key", "answer", None, "gt", "label", "answer"),
        ("tool_key", None, "fns", None, "tools", "fns"),
    ],
)
def test_inheritance_chain(tmp_path, field, dataset, defaults, eval_flag, rollout, expected):
    entry = {"name": "d", "path": "d.jsonl"}
    if dataset is not None:
        entry[field] = dataset
    section = {"datasets": [entry]}
    if defaults is not None:
        section["defaults"] = {field: defaults}
    path = _config(tmp_path, yaml.safe_dump({"eval": section}))
    rollout_attr = {
        "temperature": "rollout_temperature",
        "top_k": "rollout_top_k",
        "max_response_len": "rollout_max_response_len",
        "input_key": "input_key",
        "label_key": "label_key",
        "tool_key": "tool_key",
    }[field]
    args = _args(eval_config=path, **{f"eval_{field}": eval_flag, rollout_attr: rollout})
    (ds,) = load_eval_datasets(args)
    assert getattr(ds, field) == expected


def test_prompt_data_pairs_inherit_flags():
    args = _args(
        eval_prompt_data=["aime", "/d/aime.jsonl", "gsm8k", "/d/gsm.jsonl@[0:100]"],
        eval_temperature=0.0,
        eval_max_response_len=2048,
        n_samples_per_eval_prompt=4,
        rollout_stop_token_ids=[151645],
    )
    aime, gsm = load_eval_datasets(args)
    assert gsm == EvalDataset(
        name="gsm8k",
        path="/d/gsm.jsonl@[0:100]",
        rm_type=None,
        input_key="input",
        label_key="label",
        tool_key="tools",
        metadata_key="metadata",
        n_samples_per_eval_prompt=4,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_response_len=2048,
        stop=["<|im_end|>"],
        stop_token_ids=[151645],
        min_new_tokens=None,
        custom_generate_function_path=None,
        metadata_overrides={},
    )
    assert (aime.name, aime.path) == ("aime", "/d/aime.jsonl")


def test_n_samples_never_falls_back_to_train_n(tmp_path):
    args = _args(eval_prompt_data=["x.jsonl"], n_samples_per_prompt=8, n_samples_per_eval_prompt=1)
    assert load_eval_datasets(args)[0].n_samples_per_eval_prompt == 1
    path = _config(
        tmp_path,
        "eval:\n  defaults: {n_samples_per_eval_prompt: 4}\n  datasets:\n"
        "    - {name: a, path: a.jsonl, n_samples_per_eval_prompt: 16}\n    - {name: b, path: b.jsonl}\n",
    )
    a, b = load_eval_datasets(_args(eval_config=path, n_samples_per_eval_prompt=2))
    assert (a.n_samples_per_eval_prompt, b.n_samples_per_eval_prompt) == (16, 4)


def test_lone_value_is_named_aime():
    (ds,) = load_eval_datasets(_args(eval_prompt_data=["/d/aime-2024.jsonl"]))
    assert (ds.name, ds.path) == ("aime", "/d/aime-2024.jsonl")


def test_odd_count_is_an_error():
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_prompt_data=["a", "a.jsonl", "b.jsonl"]))
    assert str(excinfo.value) == (
        "--eval-prompt-data takes NAME PATH pairs (or one lone PATH, named 'aime'); "
        "got 3 values: a a.jsonl b.jsonl. Add the missing name or path."
    )


def test_no_eval_data_gives_empty_list():
    assert load_eval_datasets(_args()) == []


def test_base64_config_replaces_prompt_data():
    text = "eval:\n  defaults: {temperature: 0.0}\n  datasets:\n    - {name: math500, path: /d/m.jsonl, rm_type: math}\n"
    spec = "base64:" + base64.b64encode(text.encode()).decode()
    (ds,) = load_eval_datasets(_args(eval_config=spec, eval_prompt_data=["old", "old.jsonl"]))
    assert (ds.name, ds.path, ds.temperature, ds.rm_type) == ("math500", "/d/m.jsonl", 0.0, "math")


def test_bad_base64_is_an_error():
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config="base64:not*base64"))
    assert str(excinfo.value).startswith("--eval-config (base64): not valid base64-encoded UTF-8 YAML (")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{path: a.jsonl}", "eval.datasets[0] has no 'name'; every dataset needs 'name' and 'path'."),
        ("{name: a}", "dataset 'a' (eval.datasets[0]) has no 'path'; every dataset needs 'name' and 'path'."),
    ],
)
def test_missing_name_or_path(tmp_path, entry, message):
    path = _config(tmp_path, f"eval:\n  datasets:\n    - {entry}\n")
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == f"--eval-config {path!r}: {message}"


def test_name_and_path_are_not_defaults(tmp_path):
    path = _config(tmp_path, "eval:\n  defaults: {path: x.jsonl}\n  datasets:\n    - {name: a, path: a.jsonl}\n")
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: unknown key 'path' in eval.defaults. Known keys: {KNOWN}. Fix or remove it."
    )


def test_bad_value_is_named(tmp_path):
    path = _config(tmp_path, "eval:\n  datasets:\n    - {name: a, path: a.jsonl, top_p: 1.5}\n")
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: dataset 'a' (eval.datasets[0]): 'top_p' must be in (0.0, 1.0], got 1.5."
    )


@pytest.mark.parametrize("value, shown", [(".nan", "nan"), (".inf", "inf")])
def test_a_non_finite_value_is_named(tmp_path, value, shown):
    path = _config(tmp_path, f"eval:\n  datasets:\n    - {{name: a, path: a.jsonl, temperature: {value}}}\n")
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: dataset 'a' (eval.datasets[0]): 'temperature' must be a finite number, got {shown}."
    )


def test_duplicate_names_are_an_error():
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_prompt_data=["a", "1.jsonl", "a", "2.jsonl"]))
    assert str(excinfo.value) == (
        "--eval-prompt-data: eval dataset name 'a' is used twice; give each dataset its own name."
    )


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: no such file. Pass a YAML file path or base64:<encoded YAML>."
    )


def test_unknown_eval_section_key(tmp_path):
    path = _config(tmp_path, "eval:\n  dataset:\n    - {name: a, path: a.jsonl}\n")
    with pytest.raises(PluginError) as excinfo:
        load_eval_datasets(_args(eval_config=path))
    assert str(excinfo.value) == (
        f"--eval-config {path!r}: unknown key 'dataset' in eval; it takes 'defaults' and 'datasets'. Fix or remove it."
    )


def test_scalar_stop_and_overrides_and_generate_path(tmp_path):
    path = _config(
        tmp_path,
        "eval:\n  defaults:\n    metadata_overrides: {lang: en}\n  datasets:\n"
        "    - name: a\n      path: a.jsonl\n      stop: '###'\n      stop_token_ids: 7\n"
        "      custom_generate_function_path: my.gen\n",
    )
    (ds,) = load_eval_datasets(_args(eval_config=path))
    assert (ds.stop, ds.stop_token_ids, ds.metadata_overrides, ds.custom_generate_function_path) == (
        ["###"],
        [7],
        {"lang": "en"},
        "my.gen",
    )


def test_sampling_params_shape():
    ds = EvalDataset(name="a", path="a.jsonl", temperature=0.0, top_p=0.95, top_k=20, max_response_len=64)
    assert sampling_params(ds, _args(rollout_skip_special_tokens=True)) == {
        "temperature": 0.0,
        "top_p": 0.95,
        "top_k": 20,
        "max_new_tokens": 64,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": True,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
