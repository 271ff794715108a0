"""What a handler's answer means, in one table:

    answer                          action       inbox          JetStream
    2xx (200, 201, 202, 204, ...)   PROCESSED    PROCESSED      ack
    409 Conflict (already done)     PROCESSED    PROCESSED      ack
    422 Unprocessable (poison)      DEAD_LETTER  DEAD_LETTER    DLQ notice, then ack
    anything else: 5xx, 3xx, other  RETRY        FAILED         nak with backoff delay
    4xx (400, 401, 403, 404, 408,
    429, ...), timeout, refused or
    broken connection

RETRY that is the handler's max_deliver-th failure becomes DEAD_LETTER
(the inbox counts failures; JetStream redelivers without a limit, so that a
delivery lost to an outage or a crash is no failure).

Why only 422 is poison: it is the handler's explicit word that the message
can never succeed. Any other unexpected answer is more often a deployment or
configuration fault (wrong URL, expired credentials, a proxy's 404 while the
handler restarts) that a retry survives once fixed, and max_deliver bounds
the cost: the message still ends in the DLQ, never lost. A 2xx other than 200
is success because the handler accepted the message (202: it took it over).
"""

from __future__ import annotations

import enum

from pgoutbox.inbox.handler_client import HandlerAnswer


class Action(enum.Enum):
    PROCESSED = "processed"
    DEAD_LETTER = "dead_letter"
    RETRY = "retry"


def decide(answer: HandlerAnswer) -> Action:
    status = answer.status
    if status is None:
        return Action.RETRY
    if 200 <= status < 300 or status == 409:
        return Action.PROCESSED
    if status == 422:
        return Action.DEAD_LETTER
    return Action.RETRY
