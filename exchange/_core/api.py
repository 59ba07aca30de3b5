"""The names of the core seam's API, which both faces give (``_compiled.py``, the C
module's; ``_pure/``, its pure-Python twin's): one list, so the two cannot drift apart
(tests/cpu/test_core_seam.py checks each face defines every name)."""

NAMES = ["HostQueue", "add_holder", "bind_from_dlpack", "bytes_add", "call_stage", "consume", "consume_exchange_api", "copy_streaming",
         "counts", "export", "holder_count", "live_records", "make_record_type", "make_tensor_type", "new_record",
         "new_tensor", "new_tensors", "peak_begin", "peak_end", "peak_value", "peek", "pending_add", "plain_task", "record_gone",
         "records_alive", "remove_holder", "reset_counts", "set_debug", "set_finalizing", "set_method_doc",
         "set_note_gone", "set_tracking", "totals"]
