// Stub of <IOSurface/IOSurfaceRef.h> (see ../README.md).
#pragma once
typedef struct __IOSurface* IOSurfaceRef;
