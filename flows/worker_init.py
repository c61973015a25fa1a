"""Imported first by the worker processes' forkserver (flows/workers.py PRELOAD): the forkserver exits when the
process that started it has died (flows.runtime.exit_with_parent), and its workers, which ask for SIGKILL when
their parent dies (flows.runtime.die_with_parent), follow it."""

from flows.runtime import exit_with_parent

exit_with_parent()
