// Stub of <mach/mach.h> (see ../README.md).
#pragma once
typedef int kern_return_t;
typedef unsigned int task_id_token_t;
