"""Pages that appear only when their data exists: scheduler decisions and FL runs.

Each optional page adds a section to the live snapshot (``count`` > 0 puts it in the nav; the
rest changes when its data does, so open pages refresh) and registers its routes on the
console router with the shared helpers. Their data comes from features that other parts of
the hub own (``cloud_hub.placement``, ``cloud_hub.store.fl``): the pages read through those
modules' own functions where they exist and through small indexed queries for the summaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from fastapi import APIRouter

    from cloud_hub.service.hub import Hub

__all__ = ["OptionalPage", "Helpers", "OPTIONAL_PAGES", "optional_extras", "add_routes"]


@dataclass(frozen=True)
class Helpers:
    """What a page needs from the console's routes module (passed in, so no import cycle)."""

    ctx: Callable[..., Awaitable[dict[str, Any]]]  # (request, viewer, active, title, **extra) -> template context
    page_viewer: Callable[..., Awaitable[Any]]  # the dependency: signed-in viewer or redirect/401
    bad_request: Callable[..., Any]  # (request, viewer, message, status=400) -> error page
    hub: Callable[..., "Hub"]  # (request) -> Hub


@dataclass(frozen=True)
class OptionalPage:
    key: str
    href: str
    label: str
    summary: Callable[["Hub", str], Awaitable[dict[str, Any]]]  # must hold "count"
    register: Callable[["APIRouter", Helpers], None]


def _pages() -> list[OptionalPage]:
    from cloud_hub.console import pages_fl, pages_scheduler

    return [pages_scheduler.PAGE, pages_fl.PAGE]


OPTIONAL_PAGES: list[OptionalPage] = _pages()


def optional_extras() -> dict[str, Callable[["Hub", str], Awaitable[Any]]]:
    return {p.key: p.summary for p in OPTIONAL_PAGES}


def add_routes(router: "APIRouter", helpers: Helpers) -> None:
    for p in OPTIONAL_PAGES:
        p.register(router, helpers)
