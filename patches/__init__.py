"""SGLang integration: every hook on SGLang 0.5.16 lives here, one module per hooked subsystem.

Each module exposes ``HOOKS``: (target dotted path, hook function, hook type) triples, and may
expose ``setup()`` for registrations that are not hooks. ``sglang_ext.plugin`` resolves every
target before registering (SGLang's HookRegistry only logs a target it cannot patch).
"""
