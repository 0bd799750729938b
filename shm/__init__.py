"""POSIX shared memory for tensors between processes: segments, arenas, handles, rings.

The pieces the services use, each imported from its own module (this package imports nothing,
so `shm.errors` costs no numpy):

    arena.Arena.create(capacity)          an owner's allocator: put/view/free regions by Handle
    handle.Handle                         (segment, offset, nbytes, dtype, shape, generation)
    reader.Reader()                       a peer's validated views: view/copy/tensor(handle)
    producer.RingProducer.create(size)    the writing end of an SPSC record ring: put/try_put
    consumer.RingConsumer.attach(name)    the reading end: try_get/get/get_async
    reaper.reap()                         unlinks what dead owners left (at every process start)
    pinned.pin(segment)                   page-locks a mapping where CUDA is present

An owner closes (unlinks) what it created when it stops; what a killed owner leaves behind is
reaped by the next process to start.
"""
