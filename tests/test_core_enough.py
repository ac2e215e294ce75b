"""A fan-out asks its operation's ``enough`` only once a majority of nodes answered (the rule
:class:`~django_redlock.core.fanout.FanOut` states): a command whose answers nobody reads (an
undo's ``enough`` holds for any replies) still waits for a majority's answers, and for no
more, in the sync fan-out and in the asyncio one alike. Real redis-server processes: ``BLPOP``
on an empty list with a timeout is a command that a node answers late, when the test says."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from django_redlock.core.fanout import FanOut, fan_out
from django_redlock.core.nodes import TIMED_OUT, Node
from django_redlock.testing import RedisCluster
from tests.helpers import warm_up

#: How long after its command each of the five nodes answers (seconds; 0: at once). Two
#: quick nodes are no majority: the wait must go on for the one that answers a little later,
#: and end without the last two.
ANSWERS_AFTER = (0.0, 0.0, 0.3, 30.0, 30.0)


def _anything(replies: list[Any]) -> bool:
    """Holds for any replies: an undo's ``enough``."""
    return True


def _late_answers(nodes: Sequence[Node], key: str) -> Callable[[Node, Any], list[Any]]:
    """Builds each node's command: answered at once, or after its :data:`ANSWERS_AFTER`."""
    after = {id(node): ANSWERS_AFTER[index] for index, node in enumerate(nodes)}

    def build(node: Node, wire: Any) -> list[Any]:
        wait = after[id(node)]
        return ["PING"] if not wait else ["BLPOP", key, str(wait)]

    return build


def _check(replies: list[Any]) -> None:
    # A majority answered (the two quick nodes are not one), and the last two nodes were
    # not waited for once it had.
    assert replies[:3] == [b"PONG", b"PONG", None], replies
    assert replies[3:] == [TIMED_OUT, TIMED_OUT], replies


def test_enough_is_asked_only_once_a_majority_answered(
    redis_nodes5: RedisCluster, make_redlock: Callable[..., Any]
) -> None:
    rl = make_redlock(redis_nodes5, node_timeout=0.05)
    warm_up(rl)
    nodes = rl.nodes
    op = FanOut(len(nodes), _late_answers(nodes, "enough:sync:empty"), enough=_anything)
    fan_out(nodes, op, 5.0)
    _check(op.replies)


def test_enough_is_asked_only_once_a_majority_answered_async(
    redis_nodes5: RedisCluster, make_async_redlock: Callable[..., Any]
) -> None:
    rl = make_async_redlock(redis_nodes5, node_timeout=0.05)

    async def main() -> list[Any]:
        lock = rl.lock("enough:warm-up")
        assert await lock.acquire(blocking=False)
        await lock.release()
        return await rl._fan_out(
            _late_answers(rl.nodes, "enough:async:empty"), 5.0, enough=_anything
        )

    _check(asyncio.run(main()))
