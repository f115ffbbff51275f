from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "seed", "negative_prompt", "steps", "guidance", "shift", "num_frames", "height", "width", "image", "truncate", "scale")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    seed: int
    negative_prompt: str
    steps: int
    guidance: float
    shift: float
    num_frames: int
    height: int
    width: int
    image: str
    truncate: bool
    scale: int
    def __init__(self, prompt: _Optional[str] = ..., seed: _Optional[int] = ..., negative_prompt: _Optional[str] = ..., steps: _Optional[int] = ..., guidance: _Optional[float] = ..., shift: _Optional[float] = ..., num_frames: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., image: _Optional[str] = ..., truncate: _Optional[bool] = ..., scale: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("job_id", "progress", "mp4")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MP4_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    progress: Progress
    mp4: Mp4Piece
    def __init__(self, job_id: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., mp4: _Optional[_Union[Mp4Piece, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("phase", "queue_position", "step", "num_steps")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[Progress.Phase]
        QUEUED: _ClassVar[Progress.Phase]
        DENOISING: _ClassVar[Progress.Phase]
        ENCODING: _ClassVar[Progress.Phase]
    PHASE_UNSPECIFIED: Progress.Phase
    QUEUED: Progress.Phase
    DENOISING: Progress.Phase
    ENCODING: Progress.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    phase: Progress.Phase
    queue_position: int
    step: int
    num_steps: int
    def __init__(self, phase: _Optional[_Union[Progress.Phase, str]] = ..., queue_position: _Optional[int] = ..., step: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...

class Mp4Piece(_message.Message):
    __slots__ = ("data", "offset", "boundary", "last")
    class Boundary(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BOUNDARY_UNSPECIFIED: _ClassVar[Mp4Piece.Boundary]
        BOX: _ClassVar[Mp4Piece.Boundary]
        NAL: _ClassVar[Mp4Piece.Boundary]
        BYTES: _ClassVar[Mp4Piece.Boundary]
    BOUNDARY_UNSPECIFIED: Mp4Piece.Boundary
    BOX: Mp4Piece.Boundary
    NAL: Mp4Piece.Boundary
    BYTES: Mp4Piece.Boundary
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    boundary: Mp4Piece.Boundary
    last: bool
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., boundary: _Optional[_Union[Mp4Piece.Boundary, str]] = ..., last: _Optional[bool] = ...) -> None: ...
