// Stub of <CoreFoundation/CoreFoundation.h> (see ../README.md).
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
typedef double CFTimeInterval;
