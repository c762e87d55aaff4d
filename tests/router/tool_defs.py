"""Tool definitions the router's tool tests share."""

from __future__ import annotations

WEATHER = {  # a parameter of each JSON type, so the XML format's typed values all show
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "where": {"type": "object"},
                "tags": {"type": "array"},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city"],
        },
    },
}
