"""Offline training of what decoders learn (EAGLE draft heads, MASK-slot adapters), on data
the engine makes itself (`data`), in one shared loop (`loop`).

Nothing here is imported on the serving path; `stride draft train` starts it.
"""
