"""Which SGLang a server runs, and what that version's HTTP API asks of a client.

The ``sglang`` engine reads ``version`` from ``GET /server_info`` (``/get_server_info``
on servers older than 0.5.6, which lack the former) when it attaches to a server, and
keeps a :class:`ServerProtocol` for it. Facts read in the SGLang wheels of each version
(``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/managers/scheduler_components/weight_updater.py``):

- 0.5.6 is the first release with ``/server_info`` and ``/model_info`` (the weight version
  the engine checks after a sync) and with ``/pause_generation``'s ``mode`` (``abort``,
  ``retract``, ``in_place``); 0.5.5 and earlier pause in one mode only and are refused.
- From 0.5.21 on, ``/update_weights_from_distributed`` and ``/update_weights_from_tensor``
  answer 400 unless a session is open: ``POST /begin_weight_update`` before the first
  bucket, ``POST /end_weight_update`` after the last (a second begin, or an end without a
  begin, is 400 too). Earlier versions have neither route (404).
  ``/update_weights_from_disk`` needs no session in any version.
- From 0.5.20 on, a response whose tokens straddle a weight update carries
  ``meta_info.weight_versions`` (``[{"version", "start", "end"}]``).

``furlong serve`` reports the SGLang version whose API it follows (0.5.23).
"""

from __future__ import annotations

import attrs
from packaging.version import InvalidVersion, Version

from furlong.hooks import PluginError

__all__ = ["MIN_VERSION", "SESSION_SINCE", "TESTED_VERSIONS", "ServerProtocol", "protocol_for"]

MIN_VERSION = Version("0.5.6")
SESSION_SINCE = Version("0.5.21")
TESTED_VERSIONS = ("0.5.16", "0.5.23")  # the rules the conformance tests hold the client to


@attrs.frozen
class ServerProtocol:
    """What one server's SGLang version asks of the client.

    ``version``: as the server reports it. ``weight_session``: broadcast and tensor weight
    updates must sit between ``/begin_weight_update`` and ``/end_weight_update``.
    """

    version: Version

    @property
    def weight_session(self) -> bool:
        return self.version.release >= SESSION_SINCE.release


def protocol_for(reported: object, who: str) -> ServerProtocol:
    """The protocol of a server reporting ``version`` ``reported`` (a string such as ``"0.5.23"`` or ``"0.5.21.post1"``).

    :param who: names the server in the error.
    :raises PluginError: the version is missing, unreadable, or older than :data:`MIN_VERSION`.
    """
    try:
        version = Version(str(reported))
    except InvalidVersion:
        raise PluginError(f"{who}: its /server_info reports version {reported!r}, which is not an SGLang version; "
                          f"furlong supports SGLang {MIN_VERSION} and later.") from None
    if version.release < MIN_VERSION.release:
        raise PluginError(f"{who} runs SGLang {version}; furlong supports SGLang {MIN_VERSION} and later (earlier "
                          "servers lack /model_info and the pause modes a weight sync uses): upgrade the server, "
                          f'for example pip install "sglang>={MIN_VERSION}".')
    return ServerProtocol(version)
