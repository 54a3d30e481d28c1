"""An idle data-parallel controller that sleeps: with ``--sleep-on-idle`` (this platform's
default) it blocks on its socket, as SGLang's detokenizer does, instead of polling it without a
pause (an idle ``--dp-size 2`` server took a whole core of a 2-core host).

A fix of the platform, not of the plugin: the plugin's entry point registers it in every process
while this platform is active, with or without ``--unicache`` (``engine/plugin.py``).
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"


def around_event_loop(original: Any, dp_controller: Any) -> Any:
    from sglang.srt.managers.io_struct import sock_recv
    from sglang.srt.runtime_context import get_device

    if not get_device().sleep_on_idle:  # the scheduler reads it there too
        return original(dp_controller)

    while True:
        with dp_controller.soft_watchdog.disable():
            req = sock_recv(dp_controller.recv_from_tokenizer)
        dp_controller._request_dispatcher(req)
        dp_controller.soft_watchdog.feed()
