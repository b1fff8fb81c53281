"""Remote reward model: POST each sample to ``--rm-url`` and use the JSON answer as its reward."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from furlong.hooks import PluginError, hookimpl

__all__ = ["add_arguments", "boxed_response", "post_json", "reward"]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_RETRIES = 3
BACKOFF_S = 0.25  # sleep before retry k (k = 1, 2, ...) is BACKOFF_S * 2**(k-1)
_BODY_CHARS = 300  # how much of an error body a message quotes


_NEEDS_URL = "--rm-url: the URL of the reward server to POST samples to (e.g. --rm-url http://127.0.0.1:8000/reward)."


@hookimpl
def add_arguments(parser):
    """Add ``--remote-rm-timeout`` (float seconds, default 60) and ``--remote-rm-max-retries``
    (int, default 3), read by :func:`reward`."""
    group = parser.add_argument_group("remote_rm")
    group.add_argument("--remote-rm-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="Seconds each remote_rm HTTP request may wait for the server (connect and each read).")
    group.add_argument("--remote-rm-max-retries", type=int, default=DEFAULT_MAX_RETRIES,
                       help="Extra attempts after a failed remote_rm request (time-out, connection error, "
                            "HTTP 429 or 5xx), with exponential back-off from 0.25 s.")


@hookimpl
def configure(args, report):
    """As the run-wide reward (``--rm-type remote_rm``): ``--rm-url`` is required, the time-out positive and
    the retries at least 0, told before any model loads. (A sample that names ``remote_rm`` in its
    ``metadata["rm_type"]`` is checked when it is scored: ``configure`` is not called for those.)"""
    if not args.rm_url:
        report.error(f"--rm-type {report.plugin} needs {_NEEDS_URL}")
    if args.remote_rm_timeout <= 0:
        report.error(f"--remote-rm-timeout must be a positive number of seconds, got {args.remote_rm_timeout:g}.")
    if args.remote_rm_max_retries < 0:
        report.error(f"--remote-rm-max-retries must be at least 0, got {args.remote_rm_max_retries}.")


@hookimpl
async def reward(config, samples):
    """Score each sample with a reward server: the sample is POSTed, the JSON answer is the reward.

    Request: ``POST <--rm-url>`` with body ``{"prompt": ..., "response": ..., "label": ...}``
    (JSON, ``Content-Type: application/json``), one request per sample, all samples of the
    call concurrently. The answer body must be JSON: a number (the reward) or an object
    (a dict reward; name its training scalar with ``--reward-key``).

    Failures: a time-out, a connection error, HTTP 429 or 5xx is retried up to
    ``--remote-rm-max-retries`` times with exponential back-off (0.25 s, 0.5 s, 1 s...);
    other non-2xx statuses fail at once. A final failure raises PluginError naming the URL
    and the status or exception.

    Flags: ``--rm-url`` (required), ``--remote-rm-timeout`` (seconds per request, default
    60), ``--remote-rm-max-retries`` (default 3).

    :param samples: finished samples; ``prompt`` (str or message list), ``response`` (str)
        and ``label`` (JSON-serializable) are sent.
    :returns: one float or dict per sample, in order (``int`` answers become ``float``).
    :raises PluginError: ``--rm-url`` unset, a label that is not JSON-serializable, a
        request that fails after its retries, or an answer that is not a JSON number/object.
    """
    url = config.rm_url
    if not url:
        raise PluginError(f"reward 'remote_rm' needs {_NEEDS_URL}")
    own = config.plugin_config("remote_rm")
    timeout_s = float(own.remote_rm_timeout)
    retries = int(own.remote_rm_max_retries)
    bodies = [_body(s) for s in samples]
    return list(await asyncio.gather(*(post_json(url, body, timeout_s, retries) for body in bodies)))


def boxed_response(content: str) -> str:
    """The response ``boxed_remote_rm`` sends: the bare content of the last ``\\boxed{}``."""
    return content


async def post_json(url: str, body: bytes, timeout_s: float, retries: int) -> float | dict:
    """POST ``body`` to ``url`` with retries; the decoded JSON reward.

    :raises PluginError: after the last failed attempt, or on a 4xx other than 429, or on
        an answer that is not a JSON number or object.
    """
    attempts = max(0, retries) + 1
    for attempt in range(1, attempts + 1):
        try:
            status, text = await asyncio.to_thread(_post_once, url, body, timeout_s)
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            problem = _describe(exc, timeout_s)
        else:
            if 200 <= status < 300:
                return _decode(url, text)
            problem = f"HTTP {status}: {text[:_BODY_CHARS]!r}"
            if status != 429 and status < 500:
                raise PluginError(f"reward 'remote_rm': POST {url} failed: {problem}. "
                                  "The server rejected the request; check --rm-url and what the server expects "
                                  '(body {"prompt", "response", "label"}).')
        if attempt < attempts:
            await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1))
    raise PluginError(f"reward 'remote_rm': POST {url} failed after {attempts} attempt(s): {problem}. "
                      "Check that the reward server at --rm-url is running and healthy "
                      "(--remote-rm-timeout and --remote-rm-max-retries set the patience).")


def _post_once(url: str, body: bytes, timeout_s: float) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, answer.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:  # a non-2xx answer: report its status and body
        try:
            return exc.code, exc.read().decode("utf-8", errors="replace")
        except OSError:
            return exc.code, ""
        finally:
            exc.close()


def _describe(exc: BaseException, timeout_s: float) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):
        return f"timed out after {timeout_s:g} s"
    return f"{type(reason).__name__}: {reason}"


def _decode(url: str, text: str) -> float | dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise PluginError(f"reward 'remote_rm': POST {url} answered {text[:_BODY_CHARS]!r}; expected a JSON number "
                          "(the reward) or a JSON object (a dict reward, reduced with --reward-key).")
    return float(value) if isinstance(value, (int, float)) else value


def _body(sample) -> bytes:
    try:
        return json.dumps({"prompt": sample.prompt, "response": sample.response, "label": sample.label}).encode()
    except (TypeError, ValueError) as exc:
        raise PluginError(f"reward 'remote_rm': sample {sample.index} cannot be sent as JSON ({exc}); "
                          "its prompt and label must be JSON-serializable.") from exc
