"""Imported first by the worker processes' forkserver (flows/workers.py PRELOAD): the forkserver dies with the
process that started it (flows.runtime.die_with_parent), and so, in turn, do the workers it forks."""

from flows.runtime import die_with_parent

die_with_parent()
