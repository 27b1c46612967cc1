"""Rank 0's end of the CPU transport: the trainer's buckets broadcast over a gloo group (``gloo_wire.py``) to the
``trl_async_gloo`` engine inside every server (``gloo_receiver.py``)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

from ....weights.buckets import Buckets
from .fan_out import FanOutClient, free_port, update_info
from .gloo_wire import open_group, send_buckets


class GlooSender:
    """Rank 0's end of the CPU transport (see module docstring)."""

    def __init__(self, client: FanOutClient, bucket_bytes: int, timeout_s: float, host: str = "127.0.0.1") -> None:
        self.client = client
        init_info = {
            "master_address": host,
            "master_port": free_port(),
            "world_size": client.world_size,
            "bucket_bytes": bucket_bytes,
            "timeout_s": timeout_s,
        }
        self.timeout_s = timeout_s
        self._unsettled = None
        with ThreadPoolExecutor(max_workers=1) as pool:  # the servers block in the rendezvous until we join it
            joined = pool.submit(client.init_weight_transfer_engine, init_info)
            self.group = open_group(host, init_info["master_port"], 0, client.world_size, timeout_s)
            joined.result()

    def send(self, buckets: Buckets, specs: dict, version: int) -> None:
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        receiving = pool.submit(self.client.update_weights, update_info(specs))  # blocks in the receive
        try:
            send_buckets(self.group, buckets)
            receiving.result()
        except BaseException:
            self._unsettled = receiving  # see settle()
            raise
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the request may never return; don't wait for it
        self.client.finish_weight_update(str(version))

    def settle(self) -> None:
        """After a broadcast that broke off (a member died): the other servers stay blocked in their receive until
        the group's timeout. Wait for their calls to end (bounded), so that a new group finds them free, not wedged."""
        receiving, self._unsettled = self._unsettled, None
        if receiving is not None:
            with contextlib.suppress(BaseException):
                receiving.result(timeout=self.timeout_s + 30.0)
