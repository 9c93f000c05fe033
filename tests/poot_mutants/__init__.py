"""Deliberately broken variants of the reference server, for tests only (never installed).

Each defect is a small subclass or wrapper of one part of the server, overriding one named
method: an engine, scheduler, prefix cache, stop checker or driver subclass; a ServerState
subclass; ASGI middleware around the unchanged app; or a command-line parser subclass.
`registry.MUTANTS` names each one with the clause it must break and the reason that clause
must give; `python -m poot_mutants.serve --mutation NAME [poot-serve options]` starts one.
"""
