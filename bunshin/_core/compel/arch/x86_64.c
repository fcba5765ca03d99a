#include <errno.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>

#include "x86_64.h"

/* include/linux/errno.h: never seen by user space unless a tracer looks at the registers */
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516

const uint8_t bx_arch_syscall_insn[BX_ARCH_SYSCALL_LEN] = {0x0f, 0x05};

int bx_arch_get_regs(pid_t tid, bx_regs_t *r)
{
	return ptrace(PTRACE_GETREGS, tid, 0, r) ? -errno : 0;
}

int bx_arch_set_regs(pid_t tid, const bx_regs_t *r)
{
	return ptrace(PTRACE_SETREGS, tid, 0, r) ? -errno : 0;
}

void bx_arch_setup_syscall(bx_regs_t *r, unsigned long insn, long nr, const unsigned long a[6])
{
	r->rax = nr;
	/* orig_rax -1: the kernel must not treat the stop we resume from as a syscall to restart */
	r->orig_rax = -1;
	r->rip = insn;
	r->rdi = a[0];
	r->rsi = a[1];
	r->rdx = a[2];
	r->r10 = a[3];
	r->r8 = a[4];
	r->r9 = a[5];
}

long bx_arch_retval(const bx_regs_t *r) { return (long)r->rax; }
unsigned long bx_arch_ip(const bx_regs_t *r) { return r->rip; }
unsigned long bx_arch_sp(const bx_regs_t *r) { return r->rsp; }
unsigned long bx_arch_tls(const bx_regs_t *r) { return r->fs_base; }
int bx_arch_in_syscall(const bx_regs_t *r) { return (long)r->orig_rax >= 0; }
unsigned long bx_arch_syscall_site(const bx_regs_t *r) { return r->rip - BX_ARCH_SYSCALL_LEN; }

int bx_arch_is_restart(long rv)
{
	return rv == -ERESTARTSYS || rv == -ERESTARTNOINTR || rv == -ERESTARTNOHAND ||
	       rv == -ERESTART_RESTARTBLOCK;
}

int bx_arch_apply_restart(bx_regs_t *r)
{
	if (!bx_arch_in_syscall(r))
		return 0;
	long rv = (long)r->rax;
	int restarted = bx_arch_is_restart(rv);
	if (rv == -ERESTART_RESTARTBLOCK) {
		/* the kernel kept the rest of the work in current->restart_block */
		r->rax = SYS_restart_syscall;
		r->rip -= BX_ARCH_SYSCALL_LEN;
	} else if (restarted) {
		r->rax = r->orig_rax;
		r->rip -= BX_ARCH_SYSCALL_LEN;
	}
	r->orig_rax = -1;
	return restarted;
}
