"""Offline training of what decoders learn (EAGLE draft heads), on data the engine makes itself.

Nothing here is imported on the serving path; `stride draft train` starts it.
"""
