"""The guest side: the daemon that is PID 1 inside every sandbox, and the wire protocol it speaks.

Everything in this package is standard-library only: it runs on the template's own python3.
"""
