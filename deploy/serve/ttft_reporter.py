"""An API replica's push of its measured first tokens (cluster/first_token.py) to the autoscaler, every round.

The replicas push, the autoscaler does not pull: each API replica already holds a Serve handle to the autoscaler's
deployment (for its status), while the autoscaler has no way to reach every API replica (a Serve handle reaches one
replica of its choosing). Each push carries the replica's whole record (a snapshot, not what is new since the last
one), so a lost or repeated push costs nothing; each has a deadline, and a failed one is logged and tried again the
next round. A replica that stops pushing is left out by the autoscaler once its report is stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from cluster.first_token import FirstTokenRecord, TtftReport

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 5.0  # the autoscaler replica stores a report in memory: it answers at once, or is away


class TtftReporter:
    """Sends `record`'s report (as `replica`) through `send` every `interval_s`, each call within `timeout_s`."""

    def __init__(self, record: FirstTokenRecord, replica: str, send: Callable[[TtftReport], Awaitable[None]],
                 interval_s: float, clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = REPORT_TIMEOUT_S) -> None:
        self.record, self.replica, self.send = record, replica, send
        self.interval_s, self.clock, self.timeout_s = interval_s, clock, timeout_s
        self.failing = False  # the last push failed (logged once until one succeeds)

    async def push(self) -> bool:
        """One report; False (logged) if it failed or ran past its deadline."""
        try:
            await asyncio.wait_for(self.send(self.record.report(self.replica, self.clock())), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the autoscaler away (restarting, redeployed): the next round retries
            if not self.failing:
                log.warning("sending the TTFT report of %s to the autoscaler failed (%s: %s); retrying every %g s",
                            self.replica, type(e).__name__, e, self.interval_s)
            self.failing = True
            return False
        if self.failing:
            log.warning("the TTFT reports of %s reach the autoscaler again", self.replica)
        self.failing = False
        return True

    async def run(self) -> None:
        """Push for good (started and watched from the API replica's health checks)."""
        while True:
            await self.push()
            await asyncio.sleep(self.interval_s)
