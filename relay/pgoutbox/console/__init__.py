"""The operator console (`pgoutbox console`): server-rendered pages over the
SQL functions, acting as the PostgreSQL role a person logs in with.

settings, sessions, charts and samples import nothing beyond the standard
library and pgoutbox.core, so `pgoutbox --help` works without the `console`
extra; app (Starlette, Jinja2) is imported only when the command runs."""
