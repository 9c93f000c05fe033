"""Stored /v1/responses in memory, bounded in count and bytes: the oldest out first.

A stored response keeps, beside the object GET returns, its conversation as chat messages (its
input and its output), which a later request's previous_response_id continues."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Kept:
    response: dict
    conversation: list[dict]  # its input and its output, as chat messages
    size: int


class ResponseStore:
    """Stored responses, the oldest out first beyond `max_count` of them or `max_bytes`."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._bytes = 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return  # larger than the whole store: never kept
        self._kept[response["id"]] = Kept(response, conversation, size)
        self._bytes += size
        while len(self._kept) > self.max_count or self._bytes > self.max_bytes:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.size

    def get(self, rid: str) -> Kept | None:
        return self._kept.get(rid)

    def delete(self, rid: str) -> bool:
        old = self._kept.pop(rid, None)
        if old is not None:
            self._bytes -= old.size
        return old is not None

    def __len__(self) -> int:
        return len(self._kept)
