"""What a tool message says about its call: the marker of a failed call.

A call that fails (an unknown tool, arguments that do not fit, a raising tool, a timeout) is
answered `{"error": "<reason>"}` (`episodes.tools`), and a tool may answer so itself. The marker
lives here, below both the episode loop that writes it and the rewards that read it
(`rewards.form.tool_use_reward`), so that rewards need not import the episodes.
"""

import json


def tool_error(reason: str) -> str:
    """The content of a tool message reporting a failed call."""
    return json.dumps({"error": reason})


def is_tool_error(message: dict) -> bool:
    """Whether a tool message reports a failed call (`tool_error`'s, or a tool's own `{"error": ...}`)."""
    return str(message.get("content")).startswith('{"error": ')
