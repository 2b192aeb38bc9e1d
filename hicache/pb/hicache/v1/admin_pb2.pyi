from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthRequest(_message.Message):
    __slots__ = ("deep",)
    DEEP_FIELD_NUMBER: _ClassVar[int]
    deep: bool
    def __init__(self, deep: _Optional[bool] = ...) -> None: ...

class BackendHealth(_message.Message):
    __slots__ = ("name", "healthy", "latency_ms", "detail", "capacity_bytes", "used_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    healthy: bool
    latency_ms: float
    detail: str
    capacity_bytes: int
    used_bytes: int
    def __init__(self, name: _Optional[str] = ..., healthy: _Optional[bool] = ..., latency_ms: _Optional[float] = ..., detail: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[BackendHealth]
    def __init__(self, backends: _Optional[_Iterable[_Union[BackendHealth, _Mapping]]] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("pages_written",)
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    pages_written: int
    def __init__(self, pages_written: _Optional[int] = ...) -> None: ...
