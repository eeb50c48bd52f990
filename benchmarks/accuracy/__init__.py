"""RULER-style accuracy suite: dense vs sparse decode on the same samples through one server."""
