"""A chat stream's deltas as the Responses API's typed stream events (``response.created``,
..., ``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``), numbered in order as the SDK reads them."""

from __future__ import annotations

import json
from typing import Any

from router.api.responses.output import call_item, message_item
from router.errors import RouterError


class StreamEvents:
    """A chat stream's deltas as the Responses API's typed events, numbered in order."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton
        self.rid = skeleton["id"]
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items so far
        self.text_item: int | None = None  # the message item being written
        self.calls: dict[int, int] = {}  # tool call index -> its output item

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> str:
        return (self._event("response.created", response=self.skeleton)
                + self._event("response.in_progress", response=self.skeleton))

    def delta(self, delta: dict[str, Any]) -> str:
        out = []
        if delta.get("content"):
            if self.text_item is None:
                self.text_item = len(self.items)
                item = message_item(self.rid, self.text_item, "", "in_progress")
                item["content"] = []
                self.items.append(item)
                out.append(self._event("response.output_item.added",
                                       output_index=self.text_item, item=item))
                out.append(self._event("response.content_part.added", item_id=item["id"],
                                       output_index=self.text_item, content_index=0,
                                       part={"type": "output_text", "text": "",
                                             "annotations": []}))
                item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            item = self.items[self.text_item]
            item["content"][0]["text"] += delta["content"]
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=self.text_item, content_index=0,
                                   delta=delta["content"], logprobs=[]))
        for entry in delta.get("tool_calls") or []:
            out.append(self._call_delta(entry))
        return "".join(out)

    def _call_delta(self, entry: dict[str, Any]) -> str:
        if "id" in entry:  # a call's header: its own output item
            index = self.calls[entry["index"]] = len(self.items)
            item = call_item(self.rid, index, entry["id"], entry["function"]["name"], "",
                              "in_progress")
            self.items.append(item)
            return self._event("response.output_item.added", output_index=index, item=item)
        index = self.calls[entry["index"]]
        item = self.items[index]
        piece = entry["function"].get("arguments") or ""
        item["arguments"] += piece
        return self._event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=piece)

    def closing(self, response: dict[str, Any]) -> str:
        out = []
        for index, item in enumerate(self.items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out.append(self._event("response.output_text.done", item_id=item["id"],
                                       output_index=index, content_index=0, text=text,
                                       logprobs=[]))
                out.append(self._event("response.content_part.done", item_id=item["id"],
                                       output_index=index, content_index=0,
                                       part=item["content"][0]))
            else:
                out.append(self._event("response.function_call_arguments.done",
                                       item_id=item["id"], output_index=index,
                                       arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if response["status"] == "completed" else \
            "response.incomplete"
        out.append(self._event(kind, response=response))
        return "".join(out)

    def failed(self, error: RouterError) -> str:
        response = {**self.skeleton, "status": "failed", "output": self.items,
                    "error": {"code": error.code or error.type, "message": error.message}}
        return self._event("response.failed", response=response)
