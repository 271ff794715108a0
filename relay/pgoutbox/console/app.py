"""The console's web application: Starlette routes rendering Jinja2 templates
on the server, a stylesheet and one small script (no build chain)."""

from __future__ import annotations

import psycopg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pgoutbox.console import calls, inputs
from pgoutbox.console.pages import Pages
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.console.web import Console, Forbidden, Guard, NotLoggedIn


def create_app(cfg: ConsoleConfig) -> Starlette:
    console = Console(cfg)
    views = Pages(console)
    routes = [
        Route("/login", console.login_form, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/", console.overview, methods=["GET"]),
        *views.routes(),
        Mount("/static", StaticFiles(packages=[("pgoutbox.console", "static")]), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=console.lifespan,
        middleware=[Middleware(Guard, console=console)],
        exception_handlers={
            psycopg.Error: console.on_sql_error,
            calls.Unavailable: console.on_unavailable,
            Forbidden: console.on_forbidden,
            NotLoggedIn: console.on_not_logged_in,
            inputs.BadInput: console.on_bad_input,
        },
    )
    app.state.console = console  # tests read the samples and actions through it
    return app
