/* The batch blob for x86_64: copied into the tracee and run there, so it must be position
 * independent (relative jumps only), touch no memory but its table, and not use the stack,
 * which belongs to the stopped code. The tracer points rbx at the table and rip at the blob.
 *
 * Each 64-byte entry is {ctl, args[6], ret} (struct bx_batch_entry). References are resolved
 * in place (args[i] becomes the ret it names), then the call is made with the syscall
 * instruction right after the argument loads: a call a signal interrupts is restarted by the
 * kernel (rip -= 2, rax = orig_rax) with every argument register intact.
 *
 * An error (-4095..-1) stops the walk unless ctl allows it: bit 24 any error, bits 32..47 that
 * one errno. At the final int3, r12 points just past the last entry that ran. */
#include "x86_64.h"

__asm__(
	".pushsection .rodata\n"
	".globl bx_arch_batch_code\n"
	".hidden bx_arch_batch_code\n"
	".globl bx_arch_batch_code_end\n"
	".hidden bx_arch_batch_code_end\n"
	"bx_arch_batch_code:\n"
	"	mov %rbx, %r12\n"             /* r12: the current entry */
	"1:	mov (%r12), %r13\n"           /* r13: its ctl */
	"	cmp $-1, %r13\n"
	"	je 9f\n"
	"	xor %ecx, %ecx\n"             /* for each argument i */
	"2:	lea 16(%rcx), %edx\n"
	"	bt %rdx, %r13\n"
	"	jnc 3f\n"
	"	mov 8(%r12,%rcx,8), %rax\n"   /* a reference: the ret of entry args[i] */
	"	shl $6, %rax\n"
	"	mov 56(%rbx,%rax), %rax\n"
	"	mov %rax, 8(%r12,%rcx,8)\n"
	"3:	inc %ecx\n"
	"	cmp $6, %ecx\n"
	"	jne 2b\n"
	"	movzwl %r13w, %eax\n"
	"	mov 8(%r12), %rdi\n"
	"	mov 16(%r12), %rsi\n"
	"	mov 24(%r12), %rdx\n"
	"	mov 32(%r12), %r10\n"
	"	mov 40(%r12), %r8\n"
	"	mov 48(%r12), %r9\n"
	"	syscall\n"
	"	mov %rax, 56(%r12)\n"
	"	add $64, %r12\n"
	"	bt $24, %r13\n"               /* errors allowed: go on */
	"	jc 1b\n"
	"	cmp $-4095, %rax\n"           /* -4095..-1 (unsigned compare): an error */
	"	jb 1b\n"
	"	mov %r13, %rdx\n"             /* the one errno allowed (ctl bits 32..47), if any */
	"	shr $32, %rdx\n"
	"	neg %rdx\n"
	"	jz 9f\n"
	"	cmp %rdx, %rax\n"
	"	je 1b\n"
	"9:	int3\n"
	"bx_arch_batch_code_end:\n"
	".popsection\n");

void bx_arch_setup_batch(bx_regs_t *r, unsigned long code, unsigned long table)
{
	r->rip = code;
	r->rbx = table;
	/* as for a single call: the stop we resume from must not be taken for a syscall to
	 * restart, which would move rip back by two bytes into whatever precedes the blob */
	r->orig_rax = -1;
}

unsigned long bx_arch_batch_cursor(const bx_regs_t *r) { return r->r12; }
