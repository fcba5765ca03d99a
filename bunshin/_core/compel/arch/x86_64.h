/* x86_64 specifics behind one small interface: the register image, the syscall instruction and
 * the kernel's syscall-restart convention. Another architecture gets its own file like this. */
#ifndef BUNSHIN_COMPEL_ARCH_H
#define BUNSHIN_COMPEL_ARCH_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/user.h>

typedef struct user_regs_struct bx_regs_t;

#define BX_ARCH_SYSCALL_LEN 2
extern const uint8_t bx_arch_syscall_insn[BX_ARCH_SYSCALL_LEN];
/* Bytes below the stack pointer the ABI lets a function use without moving it. */
#define BX_ARCH_REDZONE 128

int bx_arch_get_regs(pid_t tid, bx_regs_t *r);
int bx_arch_set_regs(pid_t tid, const bx_regs_t *r);
void bx_arch_setup_syscall(bx_regs_t *r, unsigned long insn, long nr, const unsigned long a[6]);
long bx_arch_retval(const bx_regs_t *r);
unsigned long bx_arch_ip(const bx_regs_t *r);
unsigned long bx_arch_sp(const bx_regs_t *r);
unsigned long bx_arch_tls(const bx_regs_t *r);
/* Stopped inside a system call (as opposed to in user code)? */
int bx_arch_in_syscall(const bx_regs_t *r);
/* Is rv one of the kernel-internal -ERESTART* codes? */
int bx_arch_is_restart(long rv);
/* Where the syscall instruction that trapped into the kernel starts. */
unsigned long bx_arch_syscall_site(const bx_regs_t *r);
/* Turn a "stopped in an interrupted syscall" image into one that re-executes that syscall,
 * as the kernel would have on return to user mode had no signal handler run. */
int bx_arch_apply_restart(bx_regs_t *r);

/* x86_64_batch.c: the blob batch.c copies into the tracee; it ends with int3 at code_end - 1. */
extern const uint8_t bx_arch_batch_code[], bx_arch_batch_code_end[];
void bx_arch_setup_batch(bx_regs_t *r, unsigned long code, unsigned long table);
/* Where the blob's cursor stopped: just past the last entry it ran. */
unsigned long bx_arch_batch_cursor(const bx_regs_t *r);

#endif
