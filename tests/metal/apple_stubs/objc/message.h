// Stub of <objc/message.h>: the untyped entry points metal-cpp casts to typed
// function pointers (see ../README.md).
#pragma once
#include <objc/runtime.h>
extern "C" void objc_msgSend(void);
extern "C" void objc_msgSend_fpret(void);
extern "C" void objc_msgSend_stret(void);
