// Stub of <objc/runtime.h> for syntax-only checks (see ../README.md).
#pragma once
#include <stddef.h>
typedef struct objc_class* Class;
typedef struct objc_object {
  Class isa;
}* id;
typedef struct objc_selector* SEL;
typedef bool BOOL;
#define YES true
#define NO false
extern "C" SEL sel_registerName(const char* name);
extern "C" Class objc_lookUpClass(const char* name);
