"""The reward plugin README.md shows under "Writing a plugin" scores real responses correctly."""

import re
from pathlib import Path

from furlong.core.config.launch_args import launch_config
from furlong.hooks import Sample

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_plugin() -> dict:
    section = README.read_text().split("## Writing a plugin", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the documented example itself
    return namespace


def test_readme_reward_ignores_the_end_of_sequence_text_a_response_keeps():
    reward = _readme_plugin()["reward"]
    samples = [Sample(response="-5</s>", label=-5), Sample(response="\\boxed{12}<|im_end|>\n", label="12}"),
               Sample(response=" 7 ", label="7"), Sample(response="17</s>", label="71")]
    assert reward(launch_config(), samples) == [1.0, 1.0, 1.0, 0.0]
