"""The speculation modes a running server serves, for the load tests (loadtest/locustfile.py,
loadtest/bench.py): read from its model card (GET /v1/models lists them as `speculation_modes`),
so that a load test asks only for modes the server serves (`ssd serve` serves auto and ar by
default, a config may serve any of auto, ssd, sd and ar) and refuses, before sending any request,
a mode it was told to ask for that the server does not serve.

Standard library only: the locustfile imports it beside itself, the benchmark as loadtest.served_modes.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

# Sends no speculation field: the server's default mode (always served).
DEFAULT = "default"


def served_modes(host: str, model: str, api_key: str = "", timeout_s: float = 30.0) -> list[str] | None:
    """The `speculation.mode` values the server at `host` serves for `model`; None when its model
    card does not list them (a server older than the list). ValueError, with what to do, when
    the server cannot be asked or does not serve `model`."""
    url = host.rstrip("/") + "/v1/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            cards = json.load(response)["data"]
    except urllib.error.HTTPError as err:
        hint = " (set --api-key or $SSD_API_KEY)" if err.code == 401 else ""
        raise ValueError(f"GET {url} answered {err.code}{hint}") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"GET {url} failed ({err}); is the server (`make serve`) up?") from None
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
    if card is None:
        ids = [c.get("id") for c in cards if isinstance(c, dict)]
        raise ValueError(f"the server at {host} serves model {', '.join(map(str, ids))}, not {model!r} (--model)")
    modes = card.get("speculation_modes")
    return None if modes is None else [str(m) for m in modes]


def pick_modes(requested: str, served: list[str] | None, host: str = "the server") -> list[str]:
    """The modes to draw from: those of `requested` (comma-separated; empty = every mode served),
    each checked against `served` (None = not known: taken as asked, and empty asks for none,
    the server's default). A mode not served raises ValueError naming the served ones."""
    asked = list(dict.fromkeys(m.strip() for m in requested.split(",") if m.strip()))
    if not asked:
        return list(served) if served else [DEFAULT]
    missing = [m for m in asked if served is not None and m != DEFAULT and m not in served]
    if missing:
        raise ValueError(
            f"speculation mode(s) {', '.join(missing)} not served by {host}, which serves "
            f"{', '.join(served)}: leave the modes out to draw from every served one, or serve "
            "them (`ssd serve --extra-modes ...`, docs/serving.md)"
        )
    return asked
