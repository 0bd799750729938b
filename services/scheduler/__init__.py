"""The scheduler: a pure, synchronous batching policy (`scheduler.Scheduler`) and its process.

Importing the package stays cheap (standard library only): the process entry point and the
gRPC wrapper import what they need from the submodules.
"""
