"""The types of what the API takes: every number bounded by what the store holds, every value of
its own JSON type.

SQLite's INTEGER and PostgreSQL's BIGINT hold 64-bit integers: a bigger one raised
``OverflowError`` from the driver (a 500). Every integer of a request body or query is one of these
types, so its bound is checked at the edge (422); a route's own tighter bound narrows it
(``Int64 = Field(512, ge=128)``). Body fields are strict: FastAPI's default coercion took
``"auto_resume": 0`` for ``false`` and ``"memory_mb": "512"`` for 512; a JSON number is no boolean,
and a string no number. Query parameters are text by nature and are parsed, but bounded alike.
"""

from __future__ import annotations

from typing import Annotated

import annotated_types
from fastapi import Query
from pydantic import Field, Strict

INT64_MIN = -(2 ** 63)
INT64_MAX = 2 ** 63 - 1

#: An integer of a request body. A field's own bounds narrow it as ``Annotated[Int64, Field(ge=...)]``:
#: in ``x: Int64 = Field(ge=...)`` pydantic lets these bounds win over the field's (a test holds it).
Int64 = Annotated[int, Strict(), annotated_types.Ge(INT64_MIN), annotated_types.Le(INT64_MAX)]
#: A boolean of a request body (``true``/``false`` only).
Bool = Annotated[bool, Strict()]
#: A number of a request body: an integer or a finite float, never a string or a boolean.
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]

#: A sandbox's memory, in MiB (requests, pools).
MIN_MEMORY_MB, MAX_MEMORY_MB = 128, 262144
#: A sandbox's CPUs.
MAX_CPU = 64.0

#: ``?after=N``: a position in a list or stream (ids, sequence numbers).
Cursor = Annotated[int, Query(ge=0, le=INT64_MAX)]
