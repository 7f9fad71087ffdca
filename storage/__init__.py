"""Object stores, checkpoints and dataset shards for shoal.

Modules (each small, named for what it holds):

``backend``      the :class:`ObjectStore` interface and key rules
``local``/``s3``/``memory``  backends; ``uri.open_store`` picks one from a URI
``s3_config``    S3 settings from the environment / a credentials file
``errors``       StorageError hierarchy and the one place outside errors are translated
``layout``       object names inside a checkpoint store
``manifest``     manifest model, HMAC signing
``train_state``  :class:`TrainState`, what a checkpoint restores; ``rng`` its RNG part
``safe_load``    weights-only deserialization
``verify``       manifest and file verification
``checkpoint``   ``save_checkpoint`` / ``load_checkpoint`` / ``load_latest``
``latest_object`` the store's LATEST object; ``latest`` the Redis pointer
``retention``    keep-last-K and garbage collection
``durable_file`` background fdatasync for large local writes
``memcopy``      fast batched CPU tensor copy for snapshots
``resume``       Redis pointer -> store LATEST -> scan
``async_saver``  background checkpointing
``datasets``     verified, cached dataset shards; the dataset index model
``streaming``    :class:`StreamingDataset`: a map-style dataset streamed from shards
``streaming_format``  shoal's packed shard format (typed fields, no pickle)
``streaming_tar``     WebDataset tar shards
``streaming_cache``   the bounded, multi-process shard cache
``streaming_fetch``   whole shards downloaded into it and verified; the retry policy
``streaming_pack``    ``shoal dataset pack`` / ``shoal dataset index``

See docs/storage.md.
"""
