"""bertpipe."""
