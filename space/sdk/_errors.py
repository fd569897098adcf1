"""The boundary where transport failures become :mod:`space.errors` classes.

No ``httpx`` exception reaches SDK callers: timeouts become :class:`~space.errors.Timeout`,
unreachable or dropped connections :class:`~space.errors.Unavailable`, and every non-2xx response
is rebuilt from its JSON body with :func:`space.errors.from_wire`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from space import errors


@contextmanager
def translate(url: object = "the SPACE server") -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as exc:
        raise errors.Timeout(f"request to {url} timed out ({type(exc).__name__})") from exc
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise errors.InvalidRequest(f"bad server URL {url}: {exc}") from exc
    except httpx.TransportError as exc:
        raise errors.Unavailable(f"connection to {url} failed: {str(exc) or type(exc).__name__}") from exc
    except (httpx.HTTPError, httpx.StreamError) as exc:
        raise errors.Internal(f"HTTP failure talking to {url}: {exc}") from exc


def from_response(resp: httpx.Response) -> errors.SpaceError:
    """The error a non-2xx response carries (its body must already be read)."""
    body: Any
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    return errors.from_wire(resp.status_code, body)
