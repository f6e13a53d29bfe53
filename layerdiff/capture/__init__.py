"""The trace pass, framework-neutral: what a hooked module call records (session), which modules are hooked
(filters), and the half of every adapter's hooks that no framework changes (hooks)."""
